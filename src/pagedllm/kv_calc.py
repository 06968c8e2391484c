"""`pagedllm kv-calc`: KV-cache memory per token and per request, from a model's config alone.

Per token, each layer stores a key and a value vector per KV head (GQA: fewer KV heads than query
heads), so a full-attention layer costs 2 x kv_heads x head_dim x dtype bytes per token of
context (int8 / fp8: one byte per value and a 4-byte scale per KV head), while a sliding-window
layer stops growing at its window. The paged figures add what
pagedllm's block layout really holds: whole blocks, a window rounded out to blocks plus the one
being written, and the KV cache groups' unused layer slots (kv_cache_spec.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config import ModelArchConfig, parse_bytes
from pagedllm.core.kv_cache_spec import SCALE_BYTES, KVCacheSpec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp32": 4, "bf16": 2, "fp16": 2,
               "int8": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}  # fmt: skip


@dataclass
class KVMemoryReport:
    name: str
    config: ModelArchConfig
    dtype: str
    max_model_len: int
    kv_cache_memory: int
    bytes_per_token_full: int  # all full-attention layers, per token of context
    bytes_per_token_sliding: int  # all sliding layers, per token inside their window
    request_bytes: int  # one request of max_model_len tokens, exact arithmetic
    request_bytes_no_window: int  # the same if every layer kept every token
    spec: KVCacheSpec
    request_blocks: int  # pagedllm blocks one such request holds while decoding
    state_bytes: int = 0  # a hybrid model's recurrent state per sequence, whatever its length
    # With prefix caching (the server's default), a hybrid model also keeps checkpoints of that
    # state (core/state_checkpoints.py): up to one per sequence slot in a quarter of the memory.
    checkpoint_bytes: int = 0

    @property
    def num_requests(self) -> int:
        """Requests of max_model_len tokens that fit in kv_cache_memory, in pagedllm's blocks
        (and state slots, beside the prefix cache's checkpoints)."""
        per_request = self.request_bytes_paged + self.state_bytes
        checkpoints = 0
        if self.checkpoint_bytes:  # engine_config._hybrid_states' rule
            fit = self.kv_cache_memory // per_request
            checkpoints = min(self.kv_cache_memory // 4 // self.checkpoint_bytes, fit)
        return (self.kv_cache_memory - checkpoints * self.checkpoint_bytes) // per_request

    @property
    def request_bytes_paged(self) -> int:
        return self.request_blocks * self.spec.bytes_per_block


def kv_memory_report(
    config: ModelArchConfig,
    max_model_len: int | None = None,
    kv_cache_memory: str | int = "4GiB",
    dtype: str = "bfloat16",
    block_size: int = 16,
    name: str = "",
    prefix_caching: bool = True,
) -> KVMemoryReport:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    n = max_model_len or config.max_position_embeddings
    elem = DTYPE_BYTES[dtype]
    scale = SCALE_BYTES if elem == 1 else 0  # one-byte codes carry a scale per row
    per_layer = 2 * config.num_key_value_heads * (config.head_dim * elem + scale)
    windows = [  # the attention layers' (a recurrent layer keeps a state instead)
        config.layer_sliding_window(i)
        for i in range(config.num_hidden_layers)
        if not config.is_recurrent_layer(i)
    ]
    num_full = sum(w is None for w in windows)
    request = sum(per_layer * (n if w is None else min(n, w)) for w in windows)
    spec = KVCacheSpec.from_config(config, block_size, elem, scale)
    return KVMemoryReport(
        name=name or config.architecture,
        config=config,
        dtype=dtype,
        max_model_len=n,
        kv_cache_memory=parse_bytes(kv_cache_memory),
        bytes_per_token_full=per_layer * num_full,
        bytes_per_token_sliding=per_layer * (len(windows) - num_full),
        request_bytes=request,
        request_bytes_no_window=per_layer * len(windows) * n,
        spec=spec,
        request_blocks=spec.max_num_blocks(n),
        state_bytes=config.recurrent_state_bytes(elem),
        checkpoint_bytes=config.recurrent_state_bytes(elem) if prefix_caching else 0,
    )


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def format_report(r: KVMemoryReport) -> str:
    c = r.config
    windows = sorted({w for i in range(c.num_hidden_layers) if (w := c.layer_sliding_window(i))})
    num_sliding = sum(c.layer_sliding_window(i) is not None for i in range(c.num_hidden_layers))
    layers = f"{c.num_hidden_layers} layers"
    if c.num_recurrent_layers:
        layers += f" ({c.num_recurrent_layers} {c.recurrent_layer_name})"
    if num_sliding:
        layers += (
            f" ({c.num_hidden_layers - num_sliding} full attention, {num_sliding} sliding window "
            f"{'/'.join(map(str, windows))})"
        )
    heads = f"{c.num_key_value_heads} KV heads x {c.head_dim} dims"
    if c.num_attention_heads != c.num_key_value_heads:
        heads = f"{c.num_key_value_heads} KV heads (GQA, {c.num_attention_heads} query heads)" + (
            f" x {c.head_dim} dims"
        )
    lines = [
        f"model: {r.name} ({c.architecture}): {layers}, {heads}, {r.dtype}",
        f"KV bytes per token: {r.bytes_per_token_full + r.bytes_per_token_sliding:,} "
        f"({_size(r.bytes_per_token_full + r.bytes_per_token_sliding)})"
        + (
            f"; beyond the window only the full-attention layers grow: "
            f"{r.bytes_per_token_full:,} per token"
            if num_sliding
            else ""
        ),
        f"one request of {r.max_model_len} tokens: {_size(r.request_bytes)}"
        + (
            f" (without sliding windows: {_size(r.request_bytes_no_window)})" if num_sliding else ""
        ),
        f"in pagedllm's blocks ({r.spec.block_size} tokens x {r.spec.group_size} layers = "
        f"{_size(r.spec.bytes_per_block)}; {r.spec.describe()}): {r.request_blocks} blocks = "
        f"{_size(r.request_bytes_paged)} per request",
        f"requests of {r.max_model_len} tokens that fit in {_size(r.kv_cache_memory)}: "
        f"{r.num_requests}",
    ]
    if r.state_bytes:  # before the last line, which counts it
        state = (
            f"{c.recurrent_kind} state per sequence ({c.num_recurrent_layers} layers, any length): "
        )
        state += f"{_size(r.state_bytes)}; the server holds --max-num-seqs"
        if r.checkpoint_bytes:
            state += (", and up to as many prefix-caching checkpoints of it in a quarter of the "
                      "memory")  # fmt: skip
        lines.insert(-1, state)
    return "\n".join(lines)
