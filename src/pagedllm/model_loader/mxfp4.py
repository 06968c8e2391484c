"""OpenAI's gpt-oss checkpoints (openai/gpt-oss-20b, -120b, config.json's quantization_config
`quant_method: mxfp4`): each layer's experts stacked in MXFP4, taken as each expert's int6 codes.

A layer stores, for gate_up (2I rows: gate's and up's interleaved, even rows gate) and down:
  mlp.experts.gate_up_proj_blocks  uint8 [E, 2I, hidden / 32, 16]
  mlp.experts.gate_up_proj_scales  uint8 [E, 2I, hidden / 32]
  mlp.experts.gate_up_proj_bias    float [E, 2I]
  mlp.experts.down_proj_blocks / _scales / _bias: [E, hidden, I / 32, 16], [E, hidden, I / 32]...
Each expert's blocks are [out, in] (transformers 5's float tensors are [in, out]); per 32
columns, 16 bytes (byte j: column 2 j in its low nibble, 2 j + 1 in its high) of e2m1 codes and
one E8M0 exponent s: w = e2m1 * 2^(s - 127) (transformers' integrations/mxfp4.py,
convert_moe_packed_tensors).

These are a GGUF's MXFP4 blocks in another byte order, so they become the same int8x codes
(gguf_codes.py): 2 e2m1 (0, +-1, +-2, +-3, +-4, +-6, +-8, +-12: int6), a scale 2^(s - 128) per 16
columns, min 0, the file's weights exactly. At 20B a float copy of the experts alone is 48 GiB
(bfloat16: 24), so they are never dequantized all at once: each expert's projection is decoded
when the model asks for it, as codes or, for the float paths, as their dequantized weight.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from pagedllm.layers.quantization import Int8xWeight
from pagedllm.model_loader.loaded_model import LazyCodes, LazyWeights

QUANT_METHOD = "mxfp4"
_STACKED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)_(blocks|scales|bias)")
# e2m1 (a sign bit, 2 exponent bits, 1 mantissa bit) doubled: small integers.
_E2M1_X2 = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.int8)
# Each stacked projection -> its experts' (name, rows): gate_up's rows interleave gate and up.
_PARTS = {
    "gate_up_proj": (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))),
    "down_proj": (("down_proj", slice(None)),),
}


def _half_scale(exponents: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents s (uint8) -> 2^(s - 128) in float32, exactly: its bits, with s 0 and 1
    subnormal (ggml's e8m0_to_fp32_half)."""
    s = exponents.to(torch.int32)
    return torch.where(s < 2, 0x200000 << s, (s - 1) << 23).view(torch.float32)


def codes_from_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> Int8xWeight:
    """One expert's projection: blocks uint8 [N, K / 32, 16], scales uint8 [N, K / 32] -> its
    int6 codes [N, K], exactly the weights transformers dequantizes them to."""
    n, groups, _ = blocks.shape
    nibbles = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1)  # [N, G, 16, 2]: 2 j, 2 j + 1
    q = _E2M1_X2[nibbles.int()].reshape(n, groups * 32)
    scale = _half_scale(scales).repeat_interleave(2, dim=1)  # one per 16 columns
    return Int8xWeight(q, scale, torch.zeros(n, groups))


def _codes(blocks, scales, expert: int, rows: slice) -> Int8xWeight:
    return codes_from_mxfp4(blocks[expert][rows], scales[expert][rows])


def _dequantized(blocks, scales, expert: int, rows: slice) -> torch.Tensor:
    return _codes(blocks, scales, expert, rows).dequantize()


def _bias(bias, expert: int, rows: slice) -> torch.Tensor:
    return bias[expert][rows].contiguous()


def _check(stem: str, proj: str, parts: dict[str, Any], num_experts: int) -> None:
    """The stacked tensors' dtypes and shapes agree with each other and with the config, before
    anything is read (the layers check the rest against their own sizes)."""
    name = f"{stem}.{proj}"
    if "scales" not in parts:
        raise ValueError(f"{name}_blocks has no {name}_scales")
    blocks, scales = parts["blocks"], parts["scales"]
    if blocks.get_dtype() != "U8" or scales.get_dtype() != "U8":
        raise ValueError(f"{name}_blocks and _scales must be uint8 (MXFP4), not "
                         f"{blocks.get_dtype()} and {scales.get_dtype()}")  # fmt: skip
    shape, scale_shape = list(blocks.get_shape()), list(scales.get_shape())
    if len(shape) != 4 or shape[3] != 16 or shape[:3] != scale_shape or shape[0] != num_experts:
        raise ValueError(
            f"{name}_blocks has shape {shape} and {name}_scales {scale_shape}: not "
            f"[{num_experts} experts, rows, column blocks, 16 bytes] and its first three"
        )
    if proj == "gate_up_proj" and shape[1] % 2:
        raise ValueError(f"{name}_blocks has {shape[1]} rows: not gate's and up's, interleaved")
    if "bias" in parts and list(parts["bias"].get_shape()) != shape[:2]:
        raise ValueError(f"{name}_bias has shape {parts['bias'].get_shape()}, not {shape[:2]}")


def mxfp4_checkpoint(
    handles: Mapping[str, Any], num_experts: int, keep_codes: bool
) -> tuple[LazyWeights, LazyCodes]:
    """The tensors of a gpt-oss MXFP4 checkpoint (`handles`: each tensor's name -> its file's
    safetensors handle), read when asked for: each expert's gate, up and down projection under
    its own name (`model.layers.L.mlp.experts.E.gate_proj.weight`...) dequantized to float32,
    its biases, every other tensor as stored; and with `keep_codes`, the projections as codes
    too. A stack without blocks (a float checkpoint that kept the config) is left to the model
    to split, as any transformers 5 checkpoint's."""
    readers: dict[str, Callable[[], torch.Tensor]] = {}
    stacks: dict[tuple[str, str], dict[str, Any]] = {}
    for name, handle in handles.items():
        m = _STACKED.fullmatch(name)
        if m is None:
            readers[name] = functools.partial(handle.get_tensor, name)
        else:  # slices: an expert's rows are read from the file without the others'
            stacks.setdefault((m.group(1), m.group(2)), {})[m.group(3)] = handle.get_slice(name)
    code_readers, kinds = {}, {}
    for (stem, proj), parts in stacks.items():
        if "blocks" not in parts:
            for kind in parts:  # as the file has them, e.g. a float stack's bias
                key = f"{stem}.{proj}_{kind}"
                readers[key] = functools.partial(handles[key].get_tensor, key)
            continue
        _check(stem, proj, parts, num_experts)
        blocks, scales, bias = parts["blocks"], parts["scales"], parts.get("bias")
        for e in range(num_experts):
            for out, rows in _PARTS[proj]:
                name = f"{stem}.{e}.{out}"
                readers[f"{name}.weight"] = functools.partial(_dequantized, blocks, scales, e, rows)
                if bias is not None:
                    readers[f"{name}.bias"] = functools.partial(_bias, bias, e, rows)
                if keep_codes:
                    code_readers[f"{name}.weight"] = functools.partial(
                        _codes, blocks, scales, e, rows
                    )
                    kinds[f"{name}.weight"] = Int8xWeight
    return LazyWeights(readers), LazyCodes(code_readers, kinds)
