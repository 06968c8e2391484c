"""Loading a GGUF file (llama.cpp's format) of a llama-style architecture into HF-named float32
tensors. The architectures are the registry's GGUF_ARCHITECTURES (llama, qwen2, qwen3, granite,
phi3).

Three things differ from a Hugging Face checkpoint and are undone here:
  - names: `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`;
  - quantization: blocks are dequantized with the gguf package's own reference code;
  - rope layout: for the archs llama.cpp runs with "normal" (adjacent-pair) RoPE, llama and
    granite, its converter permutes the rows of attn_q / attn_k (HF's rotate-half pairs
    (i, i + d/2) become adjacent pairs (2i, 2i + 1)); we apply the inverse permutation. The NEOX
    RoPE archs (qwen2, qwen3, phi3, gemma3) keep HF's layout and are not permuted.
Gemma 3 files also store every norm weight with the 1 of Gemma's (1 + w) already added: we
subtract it again, since the model takes HF's weights.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import struct

import gguf
import numpy as np
import torch

from pagedllm.config import ModelArchConfig
from pagedllm.layers.rotary import check_rope_scaling
from pagedllm.model_loader.chat_template import ChatTemplateSecurityError
from pagedllm.model_loader.gguf_codes import code_kind, codes_from_gguf
from pagedllm.model_loader.gguf_file import GGUFFile
from pagedllm.model_loader.gguf_tokenizer import tokenizer_from_gguf_metadata
from pagedllm.model_loader.loaded_model import LazyCodes, LazyWeights, LoadedModel
from pagedllm.model_loader.tokenizer import Tokenizer
from pagedllm.models.registry import architecture_from_gguf

# GGUF architectures whose attn_q / attn_k rows llama.cpp's converter permutes.
_PERMUTED_QK_ARCHS = ("llama", "granite")

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
}
# Per-architecture names that differ from llama's (gemma3's ffn_norm is the pre-MLP norm).
_ARCH_LAYER_TENSORS = {
    "gemma3": {
        **_LAYER_TENSORS,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


# What reading a truncated or corrupt file raises from inside gguf / numpy / struct.
_CORRUPT = (
    ValueError, IndexError, KeyError, TypeError, struct.error, OverflowError, EOFError,
    UnicodeDecodeError, MemoryError,
)  # fmt: skip


@contextlib.contextmanager
def _naming(path) -> object:
    """Errors raised while loading `path` come out as ValueError naming the file (the template
    security error keeps its type): never a bare IndexError from deep inside a reader."""
    try:
        yield
    except ChatTemplateSecurityError as e:
        raise ChatTemplateSecurityError(f"{path}: {e}") from None
    except _CORRUPT as e:
        why = str(e) if type(e) is ValueError else f"{type(e).__name__}: {e}"
        raise ValueError(f"{path}: {why}") from e


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """The file parsed (gguf_file.py); a file that is not GGUF, truncated or corrupt is one
    ValueError naming the file. The last file opened stays parsed (until it changes on disk):
    an engine reads the config, the tokenizer and the weights of one file."""
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        raise ValueError(f"{path} is empty: not a GGUF file")
    try:
        stat = os.stat(path)
    except OSError:
        return GGUFFile(path)  # its own error (no such file, ...)
    return _read_gguf(os.fspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _read_gguf(path: str, size: int, mtime_ns: int) -> GGUFFile:
    """(`size` and `mtime_ns` key the cache: a file rewritten in place is read again.)"""
    try:
        return GGUFFile(path)
    except _CORRUPT as e:
        raise ValueError(
            f"{path} is not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}"
        ) from e


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


def llama3_rope_freq_factors(
    head_dim: int, rope_theta: float, factor: float, low: float, high: float, original_max: int
) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's converter writes for HF's llama3 rope scaling."""
    freqs = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original_max / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(
        wavelen < original_max / high, 1.0, np.where(wavelen > original_max / low, factor, mid)
    )


def _llama3_scaling_from_factors(
    factors: np.ndarray, head_dim: int, rope_theta: float, original_max: int
) -> dict | None:
    """Recover HF's llama3 rope_scaling dict from llama.cpp's precomputed rope_freqs factors.

    The factors are invariant under scaling (original_max, low, high) together, so original_max is
    taken from metadata (default 8192, as the converter does) and low/high are solved from the
    linear "smooth" ramp between the two bands.
    """
    factors = factors.astype(np.float64)
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    x = original_max / (2 * math.pi * rope_theta ** (np.arange(0, head_dim, 2) / head_dim))
    ramp = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
    if ramp.sum() >= 2:  # smooth = (x - low) / (high - low), linear in x
        smooth = (1 / factors[ramp] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(x[ramp], smooth, 1)
        low = -intercept / slope
        high = low + 1 / slope
    else:  # no ramp to fit: HF's defaults, checked below
        low, high = 1.0, 4.0
    low, high = round(float(low), 4), round(float(high), 4)
    rebuilt = llama3_rope_freq_factors(head_dim, rope_theta, factor, low, high, original_max)
    if not np.allclose(rebuilt, factors, rtol=1e-4, atol=1e-4):
        raise ValueError("rope_freqs in this GGUF do not follow llama3 rope scaling; not supported")
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original_max,
    }


def _rope_scaling(meta: dict, arch: str, config: ModelArchConfig, rope_freqs) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if kind not in (None, "none"):
        scaling = {"rope_type": kind, "factor": float(meta[f"{arch}.rope.scaling.factor"])}
        if orig is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        for key in ("yarn_beta_fast", "yarn_beta_slow"):
            if f"{arch}.rope.scaling.{key}" in meta:
                scaling[key.removeprefix("yarn_")] = float(meta[f"{arch}.rope.scaling.{key}"])
        return scaling
    if rope_freqs is not None:
        factors = gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type).reshape(-1)
        return _llama3_scaling_from_factors(
            factors, config.head_dim, config.rope_theta, int(orig or 8192)
        )
    return None


def _arch_options(meta: dict, arch: str, tensors: dict, head_dim: int) -> dict:
    """The ModelArchConfig options that set an architecture apart from Llama."""
    if arch == "granite":  # llama.cpp: a missing attention.scale means 1/sqrt(head_dim)
        scale = meta.get(f"{arch}.attention.scale")
        return {
            "embedding_multiplier": float(meta.get(f"{arch}.embedding_scale", 1.0)),
            "residual_multiplier": float(meta.get(f"{arch}.residual_scale", 1.0)),
            "attention_multiplier": None if scale is None else float(scale),
            "logits_scaling": float(meta.get(f"{arch}.logit_scale", 1.0)),
        }
    if arch == "phi3":
        if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
            raise ValueError("phi3 GGUF with LongRoPE factors (rope_factors_*): not supported")
        rope_dims = meta.get(f"{arch}.rope.dimension_count")
        return {"partial_rotary_factor": 1.0 if rope_dims is None else rope_dims / head_dim}
    return {}


def _config_from_metadata(meta: dict, tensors: dict) -> ModelArchConfig:
    arch = meta.get("general.architecture")
    architecture = architecture_from_gguf(arch)

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF file lacks the required metadata key {arch}.{key}")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer list in some files; llama uses one value
        kv_heads = max(kv_heads)
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        emb = tensors["output.weight" if "output.weight" in tensors else "token_embd.weight"]
        vocab = len(tokens) if tokens is not None else int(emb.shape[-1])  # ggml order: (in, out)
    eos_ids = [
        int(meta[f"tokenizer.ggml.{k}"])
        for k in ("eos_token_id", "eot_token_id", "eom_token_id")  # end of text / turn / message
        if meta.get(f"tokenizer.ggml.{k}") is not None
    ]
    head_dim = int(get("attention.key_length", hidden // heads))
    # llama.cpp's converter writes it for phi3 (0: none), not for Mistral (a "llama" file) nor
    # Qwen2. Where present it slides every layer, as HF's Phi-3 and Mistral do.
    sliding_window = int(meta.get(f"{arch}.attention.sliding_window") or 0) or None
    config = ModelArchConfig(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_output.bias" in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        mlp_bias="blk.0.ffn_down.bias" in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(eos_ids)),
        sliding_window=sliding_window,
        quantized_codes=any(code_kind(t.tensor_type) is not None for t in tensors.values()),
        **_arch_options(meta, arch, tensors, head_dim),
    )
    config.rope_scaling = _rope_scaling(meta, arch, config, tensors.get("rope_freqs.weight"))
    check_rope_scaling(config.rope_scaling)
    if arch == "gemma3":
        _gemma3_config(meta, config)
    return config


def _gemma3_config(meta: dict, config: ModelArchConfig) -> None:
    """What llama.cpp's gemma3 graph takes from metadata, or hard-codes when a file has none:
    one full-attention layer in 6, local RoPE base 10000, and attention scaled by head_dim ** -0.5
    (hidden / heads for the 27B model, the one with 62 layers)."""
    n = config.num_hidden_layers
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # one flag per layer, true for sliding ones
        sliding = [bool(x) for x in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(n)]
    config.layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]
    window = meta.get("gemma3.attention.sliding_window")
    if window is None:
        raise ValueError("GGUF file lacks the metadata key gemma3.attention.sliding_window")
    config.sliding_window = int(window)
    config.rope_local_base_freq = float(meta.get("gemma3.rope.freq_base_swa", 10000.0))
    if "gemma3.attention.scale" in meta:
        config.query_pre_attn_scalar = float(meta["gemma3.attention.scale"]) ** -2
    elif n == 62:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    else:
        config.query_pre_attn_scalar = config.head_dim
    config.attn_logit_softcapping = meta.get("gemma3.attn_logit_softcapping")
    config.final_logit_softcapping = meta.get("gemma3.final_logit_softcapping")
    # Chat turns end with <end_of_turn> (llama.cpp treats it as end of generation too).
    tokens = meta.get("tokenizer.ggml.tokens") or []
    if "<end_of_turn>" in tokens and tokens.index("<end_of_turn>") not in config.eos_token_ids:
        config.eos_token_ids.append(tokens.index("<end_of_turn>"))


def _tokenizer(meta: dict) -> Tokenizer | None:
    if "tokenizer.ggml.tokens" not in meta:
        return None
    prefix = "tokenizer.ggml."
    tok_meta = {k.removeprefix(prefix): v for k, v in meta.items() if k.startswith(prefix)}
    tok_meta["token_types"] = tok_meta.pop("token_type", None) or [1] * len(tok_meta["tokens"])
    tok_meta["chat_template"] = meta.get("tokenizer.chat_template")
    tok_meta["architecture"] = meta.get("general.architecture")
    return tokenizer_from_gguf_metadata(tok_meta)


def load_gguf(path: str | os.PathLike, keep_codes: bool = False, lazy: bool = False,
              with_tokenizer: bool = True) -> LoadedModel:  # fmt: skip
    """Read a GGUF file: config, float32 weights with HF names, and its tokenizer (unless not
    `with_tokenizer`: building it from the metadata takes a fifth of a second and more).

    keep_codes: also give the Q4_0 / Q4_1 / Q4_K / Q8_0 tensors as int4 / int8 codes (LazyCodes,
    decoded when asked for), for `--quantization` to use exactly as stored (their dequantized
    weights stay in `weights` all the same). lazy: weights dequantized one at a time as the
    model takes them (LazyWeights), not all at once."""
    reader = open_gguf(path)
    with _naming(path):
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


def _read_tensor(reader: GGUFFile, t, name: str, arch: str, heads: dict[str, int]) -> torch.Tensor:
    """One tensor, dequantized to float32 and in HF's layout."""
    try:
        array = _dequantize(reader.read(t), t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(
            f"tensor {t.name} uses GGML type {t.tensor_type.name}, which the gguf package "
            "cannot dequantize"
        ) from e
    except _CORRUPT as e:
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
    if arch == "gemma3" and name.endswith("norm.weight"):
        array = array - 1.0  # the converter stored 1 + w
    return torch.from_numpy(np.require(array, np.float32, ["C", "W"]))


def _read_codes(reader: GGUFFile, t, n_head: int | None):
    """One tensor's blocks as codes, its rows unpermuted where its floats are (n_head)."""
    raw = reader.read(t)
    if n_head is not None:  # a row permutation: it moves raw rows of blocks just as well
        raw = unpermute_from_gguf(raw, n_head)
    return codes_from_gguf(raw, t.tensor_type)


def _load_gguf(path, reader: GGUFFile, keep_codes: bool, lazy: bool, with_tokenizer: bool):
    meta = reader.metadata
    tensors = {t.name: t for t in reader.tensors}
    config = _config_from_metadata(meta, tensors)
    arch = meta["general.architecture"]
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    if arch not in _PERMUTED_QK_ARCHS:
        heads = {}  # NEOX-RoPE archs: q/k rows are stored in HF's order

    readers, code_readers, kinds = {}, {}, {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name, arch)
        if name is None:
            continue
        readers[name] = functools.partial(_read_tensor, reader, t, name, arch, heads)
        kind = code_kind(t.tensor_type)
        if keep_codes and kind is not None:
            kinds[name] = kind
            n_head = heads.get(name.split(".")[-2])
            code_readers[name] = functools.partial(_read_codes, reader, t, n_head)
    weights = LazyWeights(readers) if lazy else {name: read() for name, read in readers.items()}

    name = os.path.basename(os.fspath(path)).removesuffix(".gguf")
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=_tokenizer(meta) if with_tokenizer else None,
        name=name,
        quant_codes=LazyCodes(code_readers, kinds),
        source=os.fspath(path),
    )


def load_gguf_tokenizer(path: str | os.PathLike) -> Tokenizer | None:
    """Only the tokenizer of a GGUF file (no tensor is dequantized)."""
    reader = open_gguf(path)
    with _naming(path):
        return _tokenizer(reader.metadata)


def load_gguf_config(path: str | os.PathLike) -> ModelArchConfig:
    """Only the architecture (metadata and tensor shapes; no tensor is read)."""
    reader = open_gguf(path)
    with _naming(path):
        return _config_from_metadata(reader.metadata, {t.name: t for t in reader.tensors})
