"""LoRA adapters from disk: a PEFT directory (`adapter_config.json` + `adapter_model.safetensors`)
or a GGUF LoRA file as llama.cpp writes it (model_loader/gguf_lora.py), checked against the
base model's architecture and read into one (A, B) pair per HF module name, B already scaled.

Scaling follows PEFT: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora, per module where
rank_pattern / alpha_pattern say so. Refused with a clear error: a rank above --max-lora-rank, a
module the model lacks, embedding or LM-head adapters (and modules_to_save), DoRA, LoRA biases.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.config import ModelArchConfig

if TYPE_CHECKING:
    import torch

# The projections an adapter may target: HF names, and the fused ones some checkpoints use.
_MODULE = re.compile(
    r"model\.layers\.(\d+)\.(self_attn\.(?:q|k|v|o|qkv)_proj|mlp\.(?:gate|up|down|gate_up)_proj)"
)
_KEY = re.compile(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight")


@dataclass
class LoRAAdapter:
    """An adapter's weights: HF module name -> (A [r, in], B [out, r] x scaling)."""

    rank: int  # the largest module rank
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def load_lora_adapter(path: str, arch: ModelArchConfig, max_rank: int) -> LoRAAdapter:
    """Read and check the adapter at `path` (ValueError with the reason when it cannot run on
    this model)."""
    config, tensors = _read(path, arch)
    if config.get("peft_type", "LORA").upper() != "LORA":
        raise ValueError(f"{path}: a {config['peft_type']} adapter; only LoRA is supported")
    if config.get("use_dora"):
        raise ValueError(f"{path}: DoRA adapters are not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{path}: LoRA biases (bias={config['bias']!r}) are not supported")
    if config.get("modules_to_save"):
        raise ValueError(
            f"{path}: modules_to_save {config['modules_to_save']} (fully trained copies of "
            "base modules) are not supported"
        )
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            what = "embedding / LM-head LoRA" if "embed" in key or "lm_head" in key else key
            raise ValueError(f"{path}: {what} is not supported (tensor {key})")
        pairs.setdefault(m.group(1), {})[m.group(2)] = tensor
    if not pairs:
        raise ValueError(f"{path}: no LoRA weights in the adapter")
    modules, rank = {}, 0
    for name, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{path}: {name} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        shape = _module_shape(name, arch, path)
        r = a.shape[0]
        if a.shape != (r, shape[1]) or b.shape != (shape[0], r):
            raise ValueError(
                f"{path}: {name}'s lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not "
                f"fit the model's {shape[0]} x {shape[1]} projection"
            )
        if r > max_rank:
            raise ValueError(f"{path}: LoRA rank {r} ({name}) is above --max-lora-rank {max_rank}")
        scaling = _scaling(name, r, config)
        modules[name] = (a.float().contiguous(), (b.float() * scaling).contiguous())
        rank = max(rank, r)
    return LoRAAdapter(rank, modules)


def _read(path: str, arch: ModelArchConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    if os.path.isfile(path) and path.endswith(".gguf"):
        from pagedllm.model_loader.gguf_lora import is_gguf_lora, read_gguf_lora

        if not is_gguf_lora(path):
            raise ValueError(f"{path}: a GGUF file, but not a LoRA adapter (general.type)")
        return read_gguf_lora(path, arch)
    if not os.path.isdir(path):
        raise ValueError(f"{path}: no such adapter directory or GGUF LoRA file")
    config_file = os.path.join(path, "adapter_config.json")
    weights = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(config_file):
        raise ValueError(f"{path}: no adapter_config.json (a PEFT LoRA directory has one)")
    if not os.path.isfile(weights):
        raise ValueError(f"{path}: no adapter_model.safetensors (the adapter's weights)")
    with open(config_file) as f:
        config = json.load(f)
    from safetensors.torch import load_file  # torch: this runs in the engine's process

    return config, load_file(weights)


def projection_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection an adapter may target, by its HF leaf name."""
    h, d, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    return {
        "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "qkv_proj": (q + 2 * kv, h),
        "o_proj": (h, q), "gate_proj": (inter, h), "up_proj": (inter, h),
        "gate_up_proj": (2 * inter, h), "down_proj": (h, inter),
    }  # fmt: skip


def _module_shape(name: str, arch: ModelArchConfig, path: str) -> tuple[int, int]:
    """(out, in) of the model's projection `name`, or a ValueError if it has none."""
    m = _MODULE.fullmatch(name)
    if m is None or int(m.group(1)) >= arch.num_hidden_layers:
        raise ValueError(f"{path}: the model has no module {name} to adapt")
    if m.group(2).startswith("mlp.") and arch.is_moe_layer(int(m.group(1))):
        raise ValueError(f"{path}: {name} is in a mixture of experts, which adapters cannot adapt")
    return projection_shapes(arch)[m.group(2).split(".")[1]]


def _pattern(name: str, patterns: dict, default):
    """PEFT's rank_pattern / alpha_pattern: the first key matching the module name's end."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _scaling(name: str, r: int, config: dict) -> float:
    alpha = _pattern(name, config.get("alpha_pattern"), config.get("lora_alpha", r))
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
