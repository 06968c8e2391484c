"""LoRA adapters in llama.cpp's GGUF format (what its convert_lora_to_gguf.py writes), read back
into the names and layout of the PEFT adapter they were converted from, so that the engine's
PEFT adapter path serves them too.

The converter's layout, undone here:
  - metadata: general.type "adapter", adapter.type "lora", adapter.lora.alpha (float32; absent
    or 0 means scale 1 to llama.cpp, i.e. alpha = rank) and the base model's
    general.architecture, but none of its hyper-parameters: the base model's config is needed;
  - tensors: `<base GGUF name>.lora_a` is PEFT's lora_A [r, in] and `.lora_b` its lora_B
    [out, r], as stored (numpy's order), in F32, F16, BF16 or Q8_0;
  - q/k: where the base converter permutes the rows of attn_q / attn_k (llama, granite), its
    LoRA wrapper permutes the rows of lora_b only (rows of B @ A are rows of B); lora_a is as
    trained.
Norm vectors (mergekit-extract-lora puts them in) are skipped, as llama.cpp skips them.
"""

from __future__ import annotations

import os
from collections import Counter

import gguf
import numpy as np
import torch

from pagedllm.config import ModelArchConfig
from pagedllm.model_loader.gguf_config import open_gguf
from pagedllm.model_loader.gguf_loader import (
    _PERMUTED_QK_ARCHS,
    hf_tensor_name,
    unpermute_from_gguf,
)
from pagedllm.models.registry import GGUF_ARCHITECTURES

_KINDS = ("lora_a", "lora_b")
_UNSUPPORTED = {"token_embd.weight": "embedding", "output.weight": "LM-head"}


def _linear_shapes(c: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each linear a LoRA may target: a file made for another model fails here."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    h, f = c.hidden_size, c.intermediate_size
    return {
        "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "qkv_proj": (q + 2 * kv, h),
        "o_proj": (h, q), "gate_proj": (f, h), "up_proj": (f, h), "gate_up_proj": (2 * f, h),
        "down_proj": (h, f),
    }  # fmt: skip


def is_gguf_lora(path: str | os.PathLike) -> bool:
    """A .gguf file whose general.type is "adapter" (an unreadable file is not one: the model
    loader then gives its own error)."""
    if not os.fspath(path).endswith(".gguf") or not os.path.isfile(path):
        return False
    try:
        return open_gguf(path).metadata.get("general.type") == "adapter"
    except (OSError, ValueError):
        return False


def _float32(t) -> np.ndarray:
    try:
        return np.array(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)  # a copy
    except (NotImplementedError, ValueError) as e:
        raise ValueError(f"LoRA tensor {t.name} ({t.tensor_type.name}) cannot be read: {e}") from e


def read_gguf_lora(
    path: str | os.PathLike, arch: ModelArchConfig
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(an adapter_config-like dict, float32 tensors named as PEFT saves them) for the GGUF LoRA
    at `path`, made for a model of config `arch`; ValueError for anything it cannot represent.

    Ranks that differ between modules come out as PEFT's rank_pattern (and alpha_pattern where
    the file has no alpha, since llama.cpp's scale is then 1 for each module)."""
    reader = open_gguf(path)
    meta = reader.metadata
    kind = (meta.get("general.type"), meta.get("adapter.type"))
    if kind != ("adapter", "lora"):
        raise ValueError(f"{path} is not a GGUF LoRA adapter (general.type, adapter.type: {kind})")
    gguf_arch = meta.get("general.architecture")
    if GGUF_ARCHITECTURES.get(gguf_arch) != arch.architecture:
        raise ValueError(
            f"{path} is a LoRA for GGUF architecture {gguf_arch!r}; the model is "
            f"{arch.architecture}"
        )
    if meta.get("adapter.alora.invocation_tokens"):
        raise ValueError(f"{path} is an activated LoRA (aLoRA): not supported")
    shapes = _linear_shapes(arch)
    pairs: dict[str, dict[str, object]] = {}
    for t in reader.tensors:
        base, _, suffix = t.name.rpartition(".")
        if t.name.endswith("_norm.weight"):
            continue
        if base in _UNSUPPORTED:
            raise ValueError(f"{path}: {_UNSUPPORTED[base]} LoRA ({t.name}) is not supported")
        try:
            name = hf_tensor_name(base, gguf_arch) if suffix in _KINDS else None
        except ValueError:
            name = None
        if name is None or not name.endswith(".weight") or name.split(".")[-2] not in shapes:
            raise ValueError(f"{path}: cannot map LoRA tensor {t.name!r} to a linear layer")
        if int(name.split(".")[2]) >= arch.num_hidden_layers:
            raise ValueError(
                f"{path}: {t.name} is past the model's {arch.num_hidden_layers} layers"
            )
        pairs.setdefault(name, {})[suffix] = t

    heads = {"q_proj": arch.num_attention_heads, "k_proj": arch.num_key_value_heads}
    if gguf_arch not in _PERMUTED_QK_ARCHS:
        heads = {}  # NEOX-RoPE archs: rows stored in HF's order
    tensors, ranks = {}, {}
    for name, ab in sorted(pairs.items()):
        if len(ab) != 2:
            raise ValueError(f"{path}: {name} has only {next(iter(ab))}, not both lora_a/lora_b")
        a, b = _float32(ab["lora_a"]), _float32(ab["lora_b"])
        module = name.split(".")[-2]
        out_f, in_f = shapes[module]
        if a.ndim != 2 or (a.shape, b.shape) != ((a.shape[0], in_f), (out_f, a.shape[0])):
            raise ValueError(
                f"{path}: LoRA of {name} has lora_a {a.shape}, lora_b {b.shape}; the model's "
                f"layer is {out_f} x {in_f} (a LoRA for another model?)"
            )
        if module in heads:
            b = unpermute_from_gguf(b, heads[module])
        key = name.removesuffix(".weight")
        tensors[f"base_model.model.{key}.lora_A.weight"] = torch.from_numpy(a)
        tensors[f"base_model.model.{key}.lora_B.weight"] = torch.from_numpy(np.ascontiguousarray(b))
        ranks[key] = a.shape[0]
    if not ranks:
        raise ValueError(f"{path} holds no LoRA tensors")

    rank = Counter(ranks.values()).most_common(1)[0][0]
    alpha = float(meta.get("adapter.lora.alpha") or 0.0)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha or float(rank),
        "target_modules": sorted({key.rpartition(".")[2] for key in ranks}),
    }
    odd = {key: r for key, r in ranks.items() if r != rank}
    if odd:
        config["rank_pattern"] = odd
        if not alpha:
            config["alpha_pattern"] = {key: float(r) for key, r in odd.items()}
    return config, tensors
