"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache, samples."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.selector import get_attention_backend
from pagedllm.config import ModelArchConfig
from pagedllm.core.kv_cache_spec import KVCacheSpec
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.distributed import head_shard, step_channel, tp_group
from pagedllm.distributed.step_channel import StepInputs, pairs
from pagedllm.outputs import ModelRunnerOutput, TokenLogprobs
from pagedllm.request import Request
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler, beam_candidates, gather_logprobs

logger = logging.getLogger(__name__)


def kv_cache_spec(config: ModelArchConfig, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
    """This rank's KV cache (its share of the KV heads with tensor parallelism)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    heads = head_shard(config).num_kv_heads
    if heads != config.num_key_value_heads:
        config = dataclasses.replace(config, num_key_value_heads=heads)
    return KVCacheSpec.from_config(config, block_size, element_size)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelArchConfig,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int = 0,
        attention_backend: str = "auto",
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.kv_cache_spec = kv_cache_spec(config, block_size, dtype)
        self.sampler = Sampler(seed=seed)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_pool: torch.Tensor | None = None
        self.num_copied_blocks = 0  # copy-on-write block copies done, for tests and stats
        self.swap_pool: torch.Tensor | None = None  # host memory, the same layout as kv_pool
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.num_kv_heads = head_shard(config).num_kv_heads
        self.tp_size = tp_group().size  # rank 0 sends each step to the others (step_channel)
        # Block copies (copy-on-write, swap) run on the attention backend's kernels.
        self.copy_pool_blocks = get_attention_backend(attention_backend, device).copy_blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One preallocated pool [group_size, 2, num_blocks, block_size, kvh, d]: each layer's K
        and V are the [num_blocks, block_size, kvh, d] tensors of its slot (kv_cache_spec.py);
        without sliding windows there is one group and slot i is layer i."""
        c, spec = self.config, self.kv_cache_spec
        shape = (spec.group_size, 2, num_blocks, self.block_size, self.num_kv_heads, c.head_dim)
        pool = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_pool = pool
        slots = spec.layer_slots()
        self.kv_caches = [
            (pool[slots[i][1], 0], pool[slots[i][1], 1]) for i in range(c.num_hidden_layers)
        ]

    def allocate_swap_space(self, num_cpu_blocks: int) -> None:
        """The swap space: a second pool in host memory (pinned when the cache is on a GPU, so
        that copies are DMA). On CPU it is separate memory from kv_pool all the same."""
        shape = (*self.kv_pool.shape[:2], num_cpu_blocks, *self.kv_pool.shape[3:])
        pin = self.device.type == "cuda"
        self.swap_pool = torch.zeros(shape, dtype=self.dtype, device="cpu", pin_memory=pin)

    def swap_blocks(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Out first ((device, cpu) pairs), then in ((cpu, device) pairs): a device block swapped
        out in this step may be the destination of a swap-in. Per direction, the blocks are
        gathered into one staging buffer and cross between host and device in one copy."""
        if swap_out:
            dev, cpu = (torch.tensor(ids, dtype=torch.long) for ids in zip(*swap_out, strict=True))
            shape = (*self.kv_pool.shape[:2], len(dev), *self.kv_pool.shape[3:])
            staged = torch.empty(shape, dtype=self.dtype, device=self.device)
            self.copy_pool_blocks(self.kv_pool, staged, dev.to(self.device),
                                  torch.arange(len(dev), device=self.device))  # fmt: skip
            self.swap_pool.index_copy_(2, cpu, staged.cpu())
            self.num_swapped_out_blocks += len(swap_out)
        if swap_in:
            cpu, dev = (torch.tensor(ids, dtype=torch.long) for ids in zip(*swap_in, strict=True))
            staged = self.swap_pool.index_select(2, cpu).to(self.device)
            self.copy_pool_blocks(staged, self.kv_pool, torch.arange(len(dev), device=self.device),
                                  dev.to(self.device))  # fmt: skip
            self.num_swapped_in_blocks += len(swap_in)

    def copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        """Copy-on-write: every (source, destination) block of the step, in all layers, K and V,
        in one call over the pool."""
        src, dst = zip(*blocks_to_copy, strict=True)
        src_t = torch.tensor(src, dtype=torch.long, device=self.device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=self.device)
        self.copy_pool_blocks(self.kv_pool, self.kv_pool, src_t, dst_t)
        self.num_copied_blocks += len(blocks_to_copy)

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_logits: int) -> None:
        """One prefill of `num_tokens` through a throw-away cache, then logits for `num_logits`
        rows: the step with the largest activation footprint, for memory profiling."""
        bs, dev = self.block_size, self.device
        num_blocks = -(-num_tokens // bs)
        saved = self.kv_caches, self.kv_pool
        self.allocate_kv_cache(num_blocks)
        tables = [np.arange(num_blocks, dtype=np.int32)[None]] * len(self.kv_cache_spec.groups)
        positions = np.arange(num_tokens)
        meta = self._attention_metadata(tables, positions, np.zeros(num_tokens, np.int64),
                                        [num_tokens], [num_tokens])  # fmt: skip
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
        positions = torch.arange(num_tokens, device=dev)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        self.model.compute_logits(hidden[: min(num_logits, num_tokens)])
        self.kv_caches, self.kv_pool = saved

    def _step_inputs(self, so: SchedulerOutput) -> tuple[StepInputs, list[Request], np.ndarray]:
        """The step as host arrays (what the other ranks of a tensor-parallel group receive),
        the requests to sample, and the rows of their logits."""
        moves = [pairs(so.blocks_to_swap_out), pairs(so.blocks_to_swap_in),
                 pairs(so.blocks_to_copy)]  # fmt: skip
        reqs = so.scheduled_requests
        if not reqs:
            empty = np.empty(0, np.int64)
            return StepInputs(*moves, empty, empty, empty, empty, empty, []), [], empty
        num_scheduled = np.array([so.num_scheduled_tokens[r.seq_id] for r in reqs], np.int64)
        num_computed = np.array([r.num_computed_tokens for r in reqs], np.int64)
        query_start_loc = np.zeros(len(reqs) + 1, np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        seq_lens = num_computed + num_scheduled
        total = int(query_start_loc[-1])

        # Position of each flattened token: its request's first new position + offset in the chunk.
        req_index = np.repeat(np.arange(len(reqs)), num_scheduled)
        positions = np.arange(total) - query_start_loc[req_index] + num_computed[req_index]

        input_ids = np.empty(total, np.int64)
        for i, r in enumerate(reqs):
            input_ids[query_start_loc[i] : query_start_loc[i + 1]] = r.all_token_ids[
                num_computed[i] : seq_lens[i]
            ]

        block_tables = []  # one [num_reqs, max_blocks] table per KV cache group
        for g in range(len(self.kv_cache_spec.groups)):
            max_blocks = max(len(so.block_ids[r.seq_id][g]) for r in reqs)
            block_table = np.zeros((len(reqs), max_blocks), np.int32)
            for i, r in enumerate(reqs):
                ids = so.block_ids[r.seq_id][g]
                block_table[i, : len(ids)] = ids
            block_tables.append(block_table)

        sample_rows = [i for i, r in enumerate(reqs) if so.needs_sample(r)]
        logits_indices = query_start_loc[1:][sample_rows] - 1
        step = StepInputs(*moves, input_ids, positions, req_index, num_scheduled, seq_lens,
                          block_tables)  # fmt: skip
        return step, [reqs[i] for i in sample_rows], logits_indices

    def _run_step(self, step: StepInputs) -> torch.Tensor | None:
        """Block moves first, before any layer writes this step's K/V; then the forward pass
        (hidden states [T, hidden], or None without tokens)."""
        if len(step.swap_out) or len(step.swap_in):
            self.swap_blocks(step.swap_out.tolist(), step.swap_in.tolist())
        if len(step.copies):
            self.copy_blocks(step.copies.tolist())
        if not len(step.input_ids):
            return None
        meta = self._attention_metadata(
            step.block_tables, step.positions, step.req_index, step.query_lens, step.seq_lens
        )
        input_ids = torch.from_numpy(step.input_ids).to(self.device)
        positions = torch.from_numpy(step.positions).to(self.device)
        return self.model(input_ids, positions, self.kv_caches, meta)

    def _logits(self, hidden: torch.Tensor, rows) -> torch.Tensor | None:
        """The logits of hidden's `rows` (on rank 0; the other ranks compute their shards)."""
        rows = np.asarray(rows, np.int64)
        if self.tp_size > 1:
            step_channel.send_logits(rows)
        return self.model.compute_logits(hidden[torch.from_numpy(rows).to(self.device)])

    @torch.inference_mode()
    def run_worker(self) -> None:
        """Ranks other than 0: replay rank 0's steps until it says shutdown."""
        hidden = None
        while True:
            kind, what = step_channel.receive()
            if kind == step_channel.SHUTDOWN:
                return
            if kind == step_channel.STEP:
                hidden = self._run_step(what)
            else:
                self.model.compute_logits(hidden[torch.from_numpy(what).to(self.device)])

    def _attention_metadata(self, block_tables, positions, req_index, query_lens, seq_lens):
        """The batch's metadata: one per KV cache group when there are several (slots come from
        each group's tables), tied to the layers through `groups` / `layer_group`."""
        bs, dev = self.block_size, self.device
        metas = []
        for block_table in block_tables:
            slot_mapping = (
                block_table[req_index, positions // bs].astype(np.int64) * bs + positions % bs
            )
            if not metas:
                metas.append(
                    AttentionMetadata.build(
                        bs, slot_mapping, block_table, query_lens, seq_lens, dev
                    )
                )
                continue
            metas.append(
                metas[0].with_tables(
                    torch.from_numpy(slot_mapping).to(dev), torch.from_numpy(block_table).to(dev)
                )
            )
        if len(metas) == 1:
            return metas[0]
        layer_slots = self.kv_cache_spec.layer_slots()
        layer_group = [layer_slots[i][0] for i in range(self.config.num_hidden_layers)]
        return dataclasses.replace(metas[0], groups=metas, layer_group=layer_group)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        step, sample_reqs, logits_indices = self._step_inputs(so)
        if self.tp_size > 1:
            step_channel.send_step(step)
        hidden = self._run_step(step)
        if hidden is None:
            return ModelRunnerOutput({})
        output = ModelRunnerOutput({})
        self._prompt_logprobs(so, hidden, output)
        if not sample_reqs:
            return output
        logits = self._logits(hidden, logits_indices)
        beam_rows = [i for i, r in enumerate(sample_reqs) if r.group.is_beam_search]
        if beam_rows:
            self._beam_candidates(logits, [sample_reqs[i] for i in beam_rows], beam_rows, output)
            if len(beam_rows) == len(sample_reqs):
                return output
        # One row per sample: a group's first token repeats its sequence's logits per sample.
        rows, row_reqs, sample_indices = [], [], []
        for i, r in enumerate(sample_reqs):
            if r.group.is_beam_search:
                continue
            n = r.num_samples
            rows += [i] * n
            row_reqs += [r] * n
            sample_indices += range(n) if n > 1 else [r.sample_index]
        if rows != list(range(len(sample_reqs))):  # not just a length check: beam rows out
            logits = logits[torch.tensor(rows, device=self.device)]  # and fork rows in can tie
        self._sample(logits, row_reqs, sample_indices, output)
        return output

    def _prompt_logprobs(
        self, so: SchedulerOutput, hidden: torch.Tensor, output: ModelRunnerOutput
    ) -> None:
        """For requests asking prompt_logprobs: the raw logprob, rank and top-k of every prompt
        token this step can score (the logits at position p score the prompt token at p + 1;
        chunk ends are scored too, since the whole prompt is known)."""
        start = 0
        rows, targets, owners = [], [], []
        for r in so.scheduled_requests:
            n = so.num_scheduled_tokens[r.seq_id]
            if r.sampling_params.prompt_logprobs is not None:
                first, end = (
                    r.num_computed_tokens,
                    min(r.num_computed_tokens + n, r.num_prompt_tokens - 1),
                )
                for p in range(first, end):
                    rows.append(start + p - first)
                    targets.append(r.prompt_token_ids[p + 1])
                    owners.append((r, p + 1))
            start += n
        if not rows:
            return
        logits = self._logits(hidden, rows)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        k = max(r.sampling_params.prompt_logprobs for r, _ in owners)
        ids, lps, ranks = gather_logprobs(logprobs, k, torch.tensor(targets, device=self.device))
        ids, lps, ranks = ids.tolist(), lps.tolist(), ranks.tolist()
        for row, (r, position) in enumerate(owners):
            kr = r.sampling_params.prompt_logprobs
            top = list(zip(ids[row][1 : kr + 1], lps[row][1 : kr + 1], strict=True))
            record = TokenLogprobs(ids[row][0], lps[row][0], ranks[row], top)
            output.prompt_logprobs.setdefault(r.seq_id, []).append((position, record))

    def _sample(
        self,
        logits: torch.Tensor,
        row_reqs: list[Request],
        sample_indices: list[int],
        output: ModelRunnerOutput,
    ) -> None:
        md = SamplingMetadata.from_requests(
            row_reqs, self.config.vocab_size, self.device, sample_indices
        )
        out = self.sampler(logits, md)
        token_ids = out.sampled_token_ids.tolist()
        for r, t in zip(row_reqs, token_ids, strict=True):
            output.sampled_token_ids.setdefault(r.seq_id, []).append(t)
        if out.logprobs is None:
            return
        ids, lps, ranks = (
            out.logprob_token_ids.tolist(),
            out.logprobs.tolist(),
            out.sampled_token_ranks.tolist(),
        )
        for row, r in enumerate(row_reqs):
            k = md.num_logprobs[row]
            if k is None:
                continue
            top = list(zip(ids[row][1 : k + 1], lps[row][1 : k + 1], strict=True))
            record = TokenLogprobs(ids[row][0], lps[row][0], ranks[row], top)
            output.logprobs.setdefault(r.seq_id, []).append(record)

    def _beam_candidates(
        self,
        logits: torch.Tensor,
        beams: list[Request],
        rows: list[int],
        output: ModelRunnerOutput,
    ) -> None:
        md = SamplingMetadata.from_requests(beams, self.config.vocab_size, self.device)
        k = max(r.group.beam.num_candidates for r in beams)
        k = min(k, logits.shape[1])
        token_ids, logprobs = beam_candidates(logits[torch.tensor(rows, device=self.device)], md, k)
        token_ids, logprobs = token_ids.tolist(), logprobs.tolist()
        for i, r in enumerate(beams):
            n = r.group.beam.num_candidates
            output.beam_candidates[r.seq_id] = (token_ids[i][:n], logprobs[i][:n])
