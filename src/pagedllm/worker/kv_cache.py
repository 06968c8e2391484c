"""This rank's KV cache in memory: the pool of blocks the attention layers read and write, the
swap space in host memory, and the block moves between them (copy-on-write, swap out, swap in),
run on the attention backend's block-copy kernel."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from pagedllm.attention import kv_quant
from pagedllm.config import ModelArchConfig
from pagedllm.core.kv_cache_spec import KVCacheSpec
from pagedllm.distributed import head_shard


def kv_cache_spec(config: ModelArchConfig, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
    """This rank's KV cache (its share of the KV heads with tensor parallelism) of elements of
    `dtype` (kv_quant.storage_dtype)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    scale_bytes = kv_quant.SCALE_BYTES if kv_quant.is_quantized(dtype) else 0
    heads = head_shard(config).num_kv_heads
    if heads != config.num_key_value_heads:
        config = dataclasses.replace(config, num_key_value_heads=heads)
    return KVCacheSpec.from_config(config, block_size, element_size, scale_bytes)


class KVCache:
    """One preallocated pool [group_size, 2, num_blocks, block_size, kv_heads, row]: each
    layer's K and V are the [num_blocks, block_size, kv_heads, row] tensors of its slot
    (core/kv_cache_spec.py); without sliding windows there is one group and slot i is layer i.
    A row is head_dim values of `dtype`, or, for int8 / fp8, head_dim codes and their scale in
    a uint8 pool whose layer views are typed with the codes' dtype (attention/kv_quant.py).
    The swap space, when there is one, has the same layout in host memory."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_layers: int,
        num_blocks: int,
        num_cpu_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        copy_blocks: Callable[..., None],
    ) -> None:
        self.dtype, self.device = dtype, device
        self._copy = copy_blocks  # (src pool, dst pool, src ids, dst ids): the backend's kernel
        row = kv_quant.row_elements(spec.head_dim, dtype)
        shape = (spec.group_size, 2, num_blocks, spec.block_size, spec.num_kv_heads, row)
        pool_dtype = torch.uint8 if kv_quant.is_quantized(dtype) else dtype
        # On CPU, uninitialized: no kernel reads a slot before it is written (each reads keys
        # below its request's seq_len only), and zeroing gigabytes took seconds of start-up.
        # Elsewhere zeros, as the GPU kernels were tested.
        alloc = torch.empty if device.type == "cpu" else torch.zeros
        self.pool = alloc(shape, dtype=pool_dtype, device=device)
        slots = spec.layer_slots()
        typed = self.pool.view(dtype)
        # None for a layer without K/V (a recurrent layer: its state is the runner's StatePool's)
        self.layers = [
            (typed[slots[i][1], 0], typed[slots[i][1], 1]) if i in slots else None
            for i in range(num_layers)
        ]
        self.swap_pool = None
        if num_cpu_blocks:
            # Pinned when the cache is on a GPU, so that copies are DMA; on CPU it is separate
            # memory from the pool all the same.
            shape = (*shape[:2], num_cpu_blocks, *shape[3:])
            pin = device.type == "cuda"
            self.swap_pool = torch.zeros(shape, dtype=pool_dtype, device="cpu", pin_memory=pin)
        self.num_copied_blocks = 0  # copy-on-write block copies done, for tests and stats
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Out first ((device, cpu) pairs), then in ((cpu, device) pairs): a device block swapped
        out in this step may be the destination of a swap-in. Per direction, the blocks are
        gathered into one staging buffer and cross between host and device in one copy."""
        pool, dev_arange = self.pool, self._arange
        if swap_out:
            dev, cpu = (torch.tensor(ids, dtype=torch.long) for ids in zip(*swap_out, strict=True))
            shape = (*pool.shape[:2], len(dev), *pool.shape[3:])
            staged = torch.empty(shape, dtype=pool.dtype, device=self.device)
            self._copy(pool, staged, dev.to(self.device), dev_arange(len(dev)))
            self.swap_pool.index_copy_(2, cpu, staged.cpu())
            self.num_swapped_out_blocks += len(swap_out)
        if swap_in:
            cpu, dev = (torch.tensor(ids, dtype=torch.long) for ids in zip(*swap_in, strict=True))
            staged = self.swap_pool.index_select(2, cpu).to(self.device)
            self._copy(staged, pool, dev_arange(len(dev)), dev.to(self.device))
            self.num_swapped_in_blocks += len(swap_in)

    def copy(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        """Copy-on-write: every (source, destination) block of the step, in all layers, K and V,
        in one call over the pool."""
        src, dst = zip(*blocks_to_copy, strict=True)
        src_t = torch.tensor(src, dtype=torch.long, device=self.device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=self.device)
        self._copy(self.pool, self.pool, src_t, dst_t)
        self.num_copied_blocks += len(blocks_to_copy)

    def _arange(self, n: int) -> torch.Tensor:
        return torch.arange(n, device=self.device)
