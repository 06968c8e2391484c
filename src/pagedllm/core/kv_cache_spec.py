"""How a model's layers share the KV-cache pool: KV cache groups. Torch-free.

Full-attention layers keep every token's K/V; sliding-window layers only need the last `window`
positions, so their blocks can be released as the sequence moves on. Layers of one kind are
split into groups of equal size G, and every group gets its own block table per sequence while
all groups draw blocks from one shared pool. A physical block holds `block_size` tokens for G
layers: slot j of the pool serves the j-th layer of every group. So a block is fungible between
kinds (no fixed split of memory between full and sliding layers), and a sliding group really
returns its blocks to everyone.

Gemma 3 270M (15 sliding + 3 full layers): G = 3, one full group and five sliding groups; a
long request holds N/block_size blocks in the full group and about window/block_size + 1 in
each sliding group, instead of N/block_size for all 18 layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config import ModelArchConfig

# A quantized (int8 / fp8) cache's row of one token and KV head ends in its float32 scale
# (attention/kv_quant.py holds the format).
SCALE_BYTES = 4


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    layer_ids: tuple[int, ...]
    sliding_window: int | None  # None: full attention

    def max_num_blocks(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        """Blocks one sequence of `num_tokens` holds at most in this group, computing `chunk`
        tokens per step: a sliding group keeps what the step's first query can see (window - 1
        earlier positions) plus the chunk, rounded out to whole blocks."""
        blocks = cdiv(num_tokens, block_size)
        if self.sliding_window is None:
            return blocks
        return min(blocks, cdiv(self.sliding_window - 1 + chunk, block_size) + 1)


@dataclass(frozen=True)
class KVCacheSpec:
    groups: tuple[KVCacheGroupSpec, ...]
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int  # per value
    scale_bytes: int = 0  # per (token, KV head) row: a quantized cache's scale

    @classmethod
    def from_config(
        cls, config: ModelArchConfig, block_size: int, dtype_bytes: int, scale_bytes: int = 0
    ):
        kinds: dict[int | None, list[int]] = {}
        for layer in range(config.num_hidden_layers):
            if not config.is_recurrent_layer(layer):  # a recurrent layer keeps a state, not K/V
                kinds.setdefault(config.layer_sliding_window(layer), []).append(layer)
        if not kinds:
            raise ValueError(
                "a model without attention layers (only recurrent layers) is not supported"
            )
        # Group size: the smallest kind's layer count, so that kind fills one group exactly;
        # a larger kind's last group may be short (its unused slots are the price of sharing).
        size = min(len(layers) for layers in kinds.values())
        groups = tuple(
            KVCacheGroupSpec(tuple(layers[i : i + size]), window)
            for window, layers in sorted(kinds.items(), key=lambda kv: kv[0] is not None)
            for i in range(0, len(layers), size)
        )
        return cls(
            groups, block_size, config.num_key_value_heads, config.head_dim, dtype_bytes,
            scale_bytes,
        )  # fmt: skip

    @property
    def group_size(self) -> int:
        """Layers per physical block (the pool's first dimension)."""
        return max(len(g.layer_ids) for g in self.groups)

    @property
    def sliding_windows(self) -> list[int | None]:
        return [g.sliding_window for g in self.groups]

    @property
    def bytes_per_block(self) -> int:
        rows = 2 * self.group_size * self.block_size * self.num_kv_heads
        return rows * (self.head_dim * self.dtype_bytes + self.scale_bytes)

    def layer_slots(self) -> dict[int, tuple[int, int]]:
        """layer -> (its group, its slot in the pool's first dimension)."""
        return {
            layer: (g, slot)
            for g, group in enumerate(self.groups)
            for slot, layer in enumerate(group.layer_ids)
        }

    def max_num_blocks(self, num_tokens: int, chunk: int = 1) -> int:
        """Pool blocks one sequence of `num_tokens` holds at most, over all groups."""
        return sum(g.max_num_blocks(num_tokens, self.block_size, chunk) for g in self.groups)

    def describe(self) -> str:
        full = [g for g in self.groups if g.sliding_window is None]
        sliding = [g for g in self.groups if g.sliding_window is not None]
        parts = []
        if full:
            parts.append(f"{len(full)} full-attention")
        if sliding:
            windows = sorted({g.sliding_window for g in sliding})
            parts.append(f"{len(sliding)} sliding-window ({', '.join(map(str, windows))})")
        return f"{' + '.join(parts)} group(s) of {self.group_size} layers"
