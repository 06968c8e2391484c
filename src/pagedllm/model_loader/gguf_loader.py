"""Loading a GGUF file (llama.cpp's format) of a llama-style architecture into HF-named float32
tensors (and codes), with the config and tokenizer gguf_config.py reads. The architectures are
the registry's GGUF_ARCHITECTURES.

Three things differ from a Hugging Face checkpoint and are undone here:
  - names: `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`, and a mixture
    of experts' stacked `blk.3.ffn_up_exps.weight` -> each expert e's
    `model.layers.3.mlp.experts.{e}.up_proj.weight`;
  - quantization: blocks are dequantized with the gguf package's own reference code;
  - rope layout: for the archs llama.cpp runs with "normal" (adjacent-pair) RoPE, llama and
    granite, its converter permutes the rows of attn_q / attn_k (HF's rotate-half pairs
    (i, i + d/2) become adjacent pairs (2i, 2i + 1)); we apply the inverse permutation. The NEOX
    RoPE archs (qwen2, qwen3, phi3, gemma3) keep HF's layout and are not permuted.
Gemma 3 files also store every norm weight with the 1 of Gemma's (1 + w) already added: we
subtract it again, since the model takes HF's weights.
"""

from __future__ import annotations

import functools
import os
import re

import gguf
import numpy as np
import torch

from pagedllm.model_loader.gguf_codes import code_kind, codes_from_gguf
from pagedllm.model_loader.gguf_config import (
    CORRUPT,
    config_from_metadata,
    naming,
    open_gguf,
    tokenizer_from_metadata,
)
from pagedllm.model_loader.gguf_file import GGUFFile
from pagedllm.model_loader.loaded_model import LazyCodes, LazyWeights, LoadedModel

# GGUF architectures whose attn_q / attn_k rows llama.cpp's converter permutes.
_PERMUTED_QK_ARCHS = ("llama", "granite", "granitehybrid")

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # phi3: q, k, v stored fused, as in its HF checkpoint
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",  # and its shared expert
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# A mixture of experts' stacked [experts, rows, columns] tensors -> each expert's projection.
_EXPERT_TENSORS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
# Per-architecture names that differ from llama's (gemma3's ffn_norm is the pre-MLP norm).
# A hybrid's Mamba-2 layers (granitehybrid): HF names, and how llama.cpp's converter stored
# them (A as -exp(A_log); D, A and the norm's weight reshaped; conv1d's weight squeezed).
_MAMBA_TENSORS = {
    "ssm_in": "mamba.in_proj",
    "ssm_out": "mamba.out_proj",
    "ssm_conv1d": "mamba.conv1d",
    "ssm_dt": "mamba.dt_bias",
    "ssm_a": "mamba.A_log",
    "ssm_d": "mamba.D",
    "ssm_norm": "mamba.norm",
}
# Qwen3-Next's and Qwen3.5's Gated DeltaNet layers: llama.cpp's converter splits in_proj_qkvz
# into attn_qkv (q, k, v of all heads) and attn_gate (z), keeps Qwen3-Next's interleaved
# in_proj_ba whole, stores A as -exp(A_log) and every norm weight but ssm_norm as 1 + w.
_LINEAR_ATTN_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_ARCH_LAYER_TENSORS = {
    "granitehybrid": {**_LAYER_TENSORS, **_MAMBA_TENSORS},
    "qwen3next": _LINEAR_ATTN_TENSORS,
    "qwen35": _LINEAR_ATTN_TENSORS,
    "qwen35moe": _LINEAR_ATTN_TENSORS,
    "gpt-oss": {
        **_LAYER_TENSORS,
        "post_attention_norm": "post_attention_layernorm",  # the norm before the experts
        "attn_sinks": "self_attn.sinks",
    },
    "gemma3": {
        **_LAYER_TENSORS,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
# Parameters that are not a module's weight or bias in HF's checkpoints.
_OWN_PARAMETERS = ("self_attn.sinks", "mamba.A_log", "mamba.D", "mamba.dt_bias",
                   "linear_attn.A_log", "linear_attn.dt_bias")  # fmt: skip
# Architectures whose files store norm weights as 1 + w (all but a Gated DeltaNet's own).
_NORM_PLUS_ONE = ("gemma3", "qwen3next", "qwen35", "qwen35moe")
_BLOCK_RE = re.compile(r"blk\.(\d+)\.")
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)(?:\.(weight|bias))?")


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF name for a GGUF tensor name; None for tensors that are folded into the config."""
    if gguf_name == "rope_freqs.weight":
        return None  # llama3 rope scaling factors, turned into config.rope_scaling
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS and suffix in ("weight", "bias"):
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    layer_tensors = _ARCH_LAYER_TENSORS.get(arch, _LAYER_TENSORS)
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in layer_tensors:
        module = layer_tensors[m.group(2)]
        if arch == "phi3" and module == "mlp.up_proj":
            module = "mlp.gate_up_proj"  # phi3's ffn_up holds gate and up, fused as in HF
        if module in _OWN_PARAMETERS:  # (ssm_a and ssm_d have no suffix in the file)
            return f"model.layers.{m.group(1)}.{module}"
        if m.group(3) is not None:
            return f"model.layers.{m.group(1)}.{module}.{m.group(3)}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in a {arch} GGUF file")


def unpermute_from_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's q/k row permutation, which is
    `w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2)` (HF -> GGUF layout)."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def load_gguf(path: str | os.PathLike, keep_codes: bool = False, lazy: bool = False,
              with_tokenizer: bool = True) -> LoadedModel:  # fmt: skip
    """Read a GGUF file: config, float32 weights with HF names, and its tokenizer (unless not
    `with_tokenizer`: building it from the metadata takes a fifth of a second and more).

    keep_codes: also give the Q4_0 / Q4_1 / Q4_K / Q8_0 tensors as int4 / int8 codes (LazyCodes,
    decoded when asked for), for `--quantization` to use exactly as stored (their dequantized
    weights stay in `weights` all the same). lazy: weights dequantized one at a time as the
    model takes them (LazyWeights), not all at once."""
    reader = open_gguf(path)
    with naming(path):
        return _load_gguf(path, reader, keep_codes, lazy, with_tokenizer)


# Rows dequantized at a time: the gguf package holds a float32 copy of what it is given besides
# its output, which for a whole embedding is another 100 MB and more at the peak of a load.
_DEQUANTIZE_ROWS = 4096


def _dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """float32, row blocks at a time into one array (rows dequantize on their own)."""
    if data.ndim < 2 or data.shape[0] <= _DEQUANTIZE_ROWS:
        return gguf.quants.dequantize(data, qtype)
    step = _DEQUANTIZE_ROWS
    first = gguf.quants.dequantize(data[:step], qtype)
    out = np.empty((data.shape[0], *first.shape[1:]), np.float32)
    out[:step] = first
    for start in range(step, data.shape[0], step):
        out[start : start + step] = gguf.quants.dequantize(data[start : start + step], qtype)
    return out


def expert_names(gguf_name: str, num_experts: int) -> list[str] | None:
    """The HF names of each expert's part of a stacked expert tensor; None for another tensor."""
    m = _LAYER_RE.fullmatch(gguf_name)
    if not m or m.group(2) not in _EXPERT_TENSORS:
        return None
    proj = _EXPERT_TENSORS[m.group(2)]
    layer, kind = m.group(1), m.group(3)
    return [f"model.layers.{layer}.mlp.experts.{e}.{proj}.{kind}" for e in range(num_experts)]


def _read_tensor(
    reader: GGUFFile, t, name: str, arch: str, heads: dict[str, int], expert: int | None = None
) -> torch.Tensor:
    """One tensor (or one expert's part of a stacked one), dequantized to float32 and in HF's
    layout."""
    try:
        array = _dequantize(reader.read(t, expert), t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(
            f"tensor {t.name} uses GGML type {t.tensor_type.name}, which the gguf package "
            "cannot dequantize"
        ) from e
    except CORRUPT as e:
        raise ValueError(f"tensor {t.name} cannot be read: {type(e).__name__}: {e}") from e
    proj = name.split(".")[-2]
    if proj in heads:
        rows = array.shape[0] if array.ndim == 2 else 0
        if rows % (2 * heads[proj]):
            raise ValueError(
                f"tensor {t.name} has shape {tuple(array.shape)}: its {rows} rows do not "
                f"split into {heads[proj]} heads of (pairs of) rotary dimensions"
            )
        array = unpermute_from_gguf(array, heads[proj])
    if arch in _NORM_PLUS_ONE and name.endswith("norm.weight") and ".linear_attn." not in name:
        array = array - 1.0  # the converter stored 1 + w
    if ".mamba." in name or ".linear_attn." in name:
        array = _recurrent_from_gguf(name, array)
    return torch.from_numpy(np.require(array, np.float32, ["C", "W"]))


def _recurrent_from_gguf(name: str, array: np.ndarray) -> np.ndarray:
    """A Mamba-2 (or Gated DeltaNet) tensor back in HF's form: A_log = log(-A), D and the norm's
    weight flat, the depthwise conv's weight [channels, 1, kernel]."""
    if name.endswith("A_log"):
        return np.log(-array.reshape(-1))
    if name.endswith((".D", "norm.weight")):
        return array.reshape(-1)
    if name.endswith("conv1d.weight"):
        return array.reshape(array.shape[0], 1, -1)
    return array


def _read_codes(reader: GGUFFile, t, n_head: int | None, expert: int | None = None):
    """One tensor's (or expert's) blocks as codes, its rows unpermuted where its floats are
    (n_head)."""
    raw = reader.read(t, expert)
    if n_head is not None:  # a row permutation: it moves raw rows of blocks just as well
        raw = unpermute_from_gguf(raw, n_head)
    return codes_from_gguf(raw, t.tensor_type)


def _load_gguf(path, reader: GGUFFile, keep_codes: bool, lazy: bool, with_tokenizer: bool):
    meta = reader.metadata
    tensors = {t.name: t for t in reader.tensors}
    config = config_from_metadata(meta, tensors)
    arch = meta["general.architecture"]
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    if arch not in _PERMUTED_QK_ARCHS:
        heads = {}  # NEOX-RoPE archs: q/k rows are stored in HF's order

    readers, code_readers, kinds = {}, {}, {}
    for t in reader.tensors:
        block = _BLOCK_RE.match(t.name)
        if block and int(block.group(1)) >= config.num_hidden_layers:
            continue  # a multi-token-prediction block (config_from_metadata)
        experts = expert_names(t.name, config.num_experts)
        if experts is not None:
            if len(t.shape) not in (2, 3) or t.shape[-1] != config.num_experts:  # ggml order
                raise ValueError(
                    f"tensor {t.name} has shape {tuple(reversed(t.shape))}, not one of "
                    f"{config.num_experts} experts"
                )
            parts = [(name, e) for e, name in enumerate(experts)]
        else:
            name = hf_tensor_name(t.name, arch)
            parts = [] if name is None else [(name, None)]
        kind = code_kind(t.tensor_type)
        for name, e in parts:
            readers[name] = functools.partial(_read_tensor, reader, t, name, arch, heads, e)
            if keep_codes and kind is not None:
                kinds[name] = kind
                n_head = heads.get(name.split(".")[-2])
                code_readers[name] = functools.partial(_read_codes, reader, t, n_head, e)
    weights = LazyWeights(readers) if lazy else {name: read() for name, read in readers.items()}

    name = os.path.basename(os.fspath(path)).removesuffix(".gguf")
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=tokenizer_from_metadata(meta) if with_tokenizer else None,
        name=name,
        quant_codes=LazyCodes(code_readers, kinds),
        source=os.fspath(path),
    )
