"""Turns a SchedulerOutput into tensors and runs the model over the paged KV cache.

A step has three parts, so that every rank of a tensor-parallel group runs the same message:
`prepare_inputs` (rank 0) makes the step message (distributed/step_channel.py: block moves,
token ids, positions, block tables, the rows whose logits are needed) and a plan of what to do
with the logits; `execute` (every rank) moves blocks, runs the forward pass and the LM head;
`sample` (rank 0) hands the logits to the step sampler (sample/step_sampler.py: tokens, drafts
verified, beam candidates, logprobs, pooling, and the seeded generators it keeps per request),
then asks the proposer for the next step's drafts."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.selector import get_attention_backend
from pagedllm.config import ModelArchConfig
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.distributed.step_channel import StepInputs, pairs
from pagedllm.models.fused_decoder import FusedDecoder
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.sample.step_sampler import StepLogits, StepPlan, StepSampler
from pagedllm.sequence import Sequence
from pagedllm.spec_decode import Proposer
from pagedllm.worker.kv_cache import KVCache, kv_cache_spec
from pagedllm.worker.lora_manager import LoRAManager
from pagedllm.worker.state_pool import StatePool


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelArchConfig,
        block_size: int,
        device: torch.device,
        cache_dtype: torch.dtype,
        seed: int = 0,
        attention_backend: str = "auto",
        proposer: Proposer | None = None,
        lora: LoRAManager | None = None,
        fused: FusedDecoder | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = device
        self.cache_dtype = cache_dtype  # the KV pool's elements (attention/kv_quant.py)
        self.kv_cache_spec = kv_cache_spec(config, block_size, cache_dtype)
        # Rank 0's sampling: seeded generators and chunked pooling kept across steps.
        self.step_sampler = StepSampler(config.vocab_size, device, seed)
        # Speculative decoding: proposes each sampled request's drafts for the next step.
        self.proposer = proposer
        self.lora = lora  # the model's LoRA slots (--enable-lora)
        self.fused = fused  # the decoder as one C++ call, for the steps it applies to (CPU)
        self.kv_cache: KVCache | None = None
        self.state_pool: StatePool | None = None  # a hybrid model's recurrent states
        # Block copies (copy-on-write, swap) run on the attention backend's kernels.
        self._copy_blocks = get_attention_backend(attention_backend, device).copy_blocks

    def forget_requests(self) -> None:
        """Drop every request's state (another engine takes this runner over)."""
        self.step_sampler.forget_all()
        if self.state_pool is not None:
            self.state_pool.release_all()
        if self.proposer is not None:
            self.proposer.reset()

    def initialize_kv_cache(
        self,
        num_blocks: int,
        num_cpu_blocks: int = 0,
        num_state_slots: int = 0,
        num_state_checkpoints: int = 0,
    ) -> None:
        """The KV pool, and for a hybrid model `num_state_slots` slots of recurrent state and
        `num_state_checkpoints` checkpoints of it (prefix caching)."""
        self.kv_cache = self.state_pool = None  # the old pools go before the new ones
        self.kv_cache = KVCache(
            self.kv_cache_spec, self.config.num_hidden_layers, num_blocks, num_cpu_blocks,
            self.cache_dtype, self.device, self._copy_blocks,
        )  # fmt: skip
        if self.config.num_recurrent_layers:
            self.state_pool = StatePool(self.config, num_state_slots, self.model.dtype,
                                        self.device, num_state_checkpoints)  # fmt: skip

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_logits: int) -> None:
        """One prefill of `num_tokens` through a throw-away cache, then logits for `num_logits`
        rows: the step with the largest activation footprint, for memory profiling."""
        bs, dev = self.block_size, self.device
        num_blocks = -(-num_tokens // bs)
        cache = KVCache(self.kv_cache_spec, self.config.num_hidden_layers, num_blocks, 0,
                        self.cache_dtype, dev, self._copy_blocks)  # fmt: skip
        tables = [np.arange(num_blocks, dtype=np.int32)[None]] * len(self.kv_cache_spec.groups)
        positions = np.arange(num_tokens)
        meta = self._attention_metadata(tables, positions, np.zeros(num_tokens, np.int64),
                                        [num_tokens], [num_tokens])  # fmt: skip
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
        layers = cache.layers
        if self.config.num_recurrent_layers:  # one throw-away slot of state
            states = StatePool(self.config, 1, self.model.dtype, dev)
            meta.state_slots = [0]
            layers = [states.layers.get(i, c) for i, c in enumerate(layers)]
        hidden = self._forward(input_ids, torch.arange(num_tokens, device=dev), layers, meta)
        self.model.compute_logits(hidden[: min(num_logits, num_tokens)])

    # -- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, send=None) -> ModelRunnerOutput:
        """The whole step on rank 0; `send` hands the step message to the other ranks first."""
        step, plan = self.prepare_inputs(so)
        if send is not None:
            send(step)
        logits = self.execute(step)
        if self.state_pool is not None:  # prompts' states at their checkpoint, after the step
            self.state_pool.save_checkpoints(so.state_checkpoint_saves)
        return self.sample(so, plan, logits)

    def prepare_inputs(self, so: SchedulerOutput) -> tuple[StepInputs, StepPlan]:
        """The step as host arrays (what the other ranks of a tensor-parallel group receive)
        and the plan for its logits. Finished requests' generators are dropped first: a new
        request may reuse a finished one's id in this very step."""
        self.step_sampler.forget(so.finished_request_ids)
        if self.proposer is not None and so.finished_request_ids:
            self.proposer.finish(so.finished_request_ids)
        if self.state_pool is not None:
            self._move_states(so)
        step = StepInputs(
            pairs(so.blocks_to_swap_out), pairs(so.blocks_to_swap_in), pairs(so.blocks_to_copy)
        )
        reqs = so.scheduled_requests
        if not reqs:
            return step, StepPlan()
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
        spec = so.spec_token_ids
        for i, r in enumerate(reqs):
            tokens = r.all_token_ids[num_computed[i] : seq_lens[i]]
            if r.seq_id in spec:  # drafts to verify follow the known tokens
                tokens = tokens + spec[r.seq_id]
            input_ids[query_start_loc[i] : query_start_loc[i + 1]] = tokens

        block_tables = []  # one [num_reqs, max_blocks] table per KV cache group
        for g in range(len(self.kv_cache_spec.groups)):
            max_blocks = max(len(so.block_ids[r.seq_id][g]) for r in reqs)
            block_table = np.zeros((len(reqs), max_blocks), np.int32)
            for i, r in enumerate(reqs):
                ids = so.block_ids[r.seq_id][g]
                block_table[i, : len(ids)] = ids
            block_tables.append(block_table)

        plan = StepPlan()
        prompt_rows = self._plan_prompt_logprobs(so, plan)
        pooling_rows = self._plan_pooling(reqs, num_computed, query_start_loc, plan)
        sample_rows = [
            i for i, r in enumerate(reqs) if r.pooling_params is None and so.needs_sample(r)
        ]
        plan.sample_reqs = [reqs[i] for i in sample_rows]
        plan.drafts = [spec.get(reqs[i].seq_id, []) for i in sample_rows]
        # A request's last row, and before it one per draft it verifies.
        counts = np.array([len(d) + 1 for d in plan.drafts], np.int64)
        ends = np.repeat(query_start_loc[1:][sample_rows], counts)
        back = np.arange(len(ends)) - np.repeat(np.cumsum(counts), counts)
        step = dataclasses.replace(
            step, input_ids=input_ids, positions=positions, req_index=req_index,
            query_lens=num_scheduled, seq_lens=seq_lens, block_tables=block_tables,
            prompt_logits_rows=np.asarray(prompt_rows, np.int64),
            sample_logits_rows=ends + back, pooling_rows=pooling_rows,
        )  # fmt: skip
        if self.lora is not None:
            self._plan_lora(reqs, num_scheduled, step)
        if self.state_pool is not None:
            ids = [r.seq_id for r in reqs]
            step.state_slots = np.array(self.state_pool.slots(ids, num_computed.tolist()))
        return step, plan

    def _move_states(self, so: SchedulerOutput) -> None:
        """A hybrid model's state slots before the step: finished requests' go (stashed states
        too), and the freed sequences' (pruned beams: before the forks, so that a beam group
        never holds more slots than its width; a fork's parent that stopped after its fork);
        forks copy their parent's (before a swap-out takes it); a group swapped out stashes its
        sequences' states in host memory, the other preempted groups recompute from fresh
        slots; a group swapped in gets its states back into free slots; last, prefix-cache hits
        get their checkpoints. Only sequences that left lose their slots: a live one that this
        step leaves out (a group's chunks share the budget) keeps its state."""
        pool = self.state_pool
        pool.release_requests(so.finished_request_ids, stashed=True)
        parents = {parent for parent, _ in so.forked_seqs}
        pool.release([s for s in so.freed_seqs if s not in parents])
        for parent, child in so.forked_seqs:
            pool.fork(parent, child)
        pool.release([s for s in so.freed_seqs if s in parents])
        pool.swap_out(so.swapped_out_seqs)
        pool.release_requests(so.preempted_request_ids)  # the swapped out hold none by now
        pool.swap_in(so.swapped_in_seqs)
        pool.load_checkpoints(so.state_checkpoint_loads)

    def _plan_lora(self, reqs: list[Sequence], num_scheduled: np.ndarray, step: StepInputs):
        """Each token's adapter slot, and the slots to fill first."""
        adapters = {r.lora_request.lora_int_id: r.lora_request for r in reqs if r.lora_request}
        if not adapters:
            return
        slots, step.lora_loads = self.lora.plan(list(adapters.values()))
        req_slots = [-1 if r.lora_request is None else slots[r.lora_request.lora_int_id]
                     for r in reqs]  # fmt: skip
        step.lora_slots = np.repeat(np.array(req_slots, np.int64), num_scheduled)

    @staticmethod
    def _plan_pooling(reqs, num_computed, query_start_loc, plan: StepPlan) -> np.ndarray:
        """The rows each embedding request pools this step: the last prompt token's (LAST),
        the first's (CLS), or every row (MEAN, summed across chunks)."""
        parts, num_rows = [], 0
        for i, r in enumerate(reqs):
            if r.pooling_params is None:
                continue
            start, end = query_start_loc[i], query_start_loc[i + 1]
            done = num_computed[i] + end - start >= r.num_prompt_tokens
            kind = r.pooling_params.pooling_type
            if kind == "MEAN":
                first, last = start, end
            elif kind == "CLS":
                first, last = start, start + (num_computed[i] == 0)
            else:
                first, last = end - done, end
            plan.pooling.append((r, num_rows, last - first, done))
            parts.append(np.arange(first, last, dtype=np.int64))
            num_rows += last - first
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def _plan_prompt_logprobs(self, so: SchedulerOutput, plan: StepPlan) -> list[int]:
        """The rows scoring prompt tokens, for requests asking prompt_logprobs: every prompt
        token this step can score (the logits at position p score the prompt token at p + 1;
        chunk ends are scored too, since the whole prompt is known)."""
        start, rows = 0, []
        for r in so.scheduled_requests:
            n = so.num_scheduled_tokens[r.seq_id]
            if r.sampling_params.prompt_logprobs is not None:
                first = r.num_computed_tokens
                end = min(first + n, r.num_prompt_tokens - 1)
                for p in range(first, end):
                    rows.append(start + p - first)
                    plan.prompt_targets.append(r.prompt_token_ids[p + 1])
                    plan.prompt_owners.append((r, p + 1))
            start += n
        return rows

    @torch.inference_mode()
    def execute(self, step: StepInputs) -> StepLogits | None:
        """Every rank: block moves first, before any layer writes this step's K/V; then the
        forward pass and the logits of the step's rows (None without tokens)."""
        kv = self.kv_cache
        if len(step.swap_out) or len(step.swap_in):
            kv.swap(step.swap_out.tolist(), step.swap_in.tolist())
        if len(step.copies):
            kv.copy(step.copies.tolist())
        if not len(step.input_ids):
            return None
        meta = self._attention_metadata(
            step.block_tables, step.positions, step.req_index, step.query_lens, step.seq_lens
        )
        input_ids = torch.from_numpy(step.input_ids).to(self.device)
        positions = torch.from_numpy(step.positions).to(self.device)
        if self.lora is not None:
            for slot, lora_request in step.lora_loads:
                self.lora.load(slot, lora_request)
            self.lora.set_mapping(step.lora_slots)
        layers = kv.layers
        if self.state_pool is not None:  # a recurrent layer's "cache" is its state pool
            meta.state_slots = step.state_slots.tolist()
            layers = [self.state_pool.layers.get(i, c) for i, c in enumerate(layers)]
        try:
            hidden = self._forward(input_ids, positions, layers, meta)
        finally:
            if self.lora is not None:
                self.lora.set_mapping(None)
        pooling = None
        if len(step.pooling_rows):
            pooling = hidden[torch.from_numpy(step.pooling_rows).to(self.device)].float()
        return StepLogits(
            self._logits(hidden, step.prompt_logits_rows),
            self._logits(hidden, step.sample_logits_rows),
            pooling,
        )

    def _forward(self, input_ids, positions, kv_layers, meta) -> torch.Tensor:
        """The model's hidden states: through the fused decoder where it applies (decode steps,
        short chunks), else the modules."""
        fused = self.fused
        if fused is not None and fused.applies(len(input_ids), meta):
            row_slots = None if self.lora is None else self.lora.row_slots
            hidden = self.model.model.embed(input_ids)
            return fused(hidden, positions, kv_layers, meta, row_slots)
        return self.model(input_ids, positions, kv_layers, meta)

    def _logits(self, hidden: torch.Tensor, rows: np.ndarray) -> torch.Tensor | None:
        """The logits of hidden's `rows`: on rank 0, gathered; elsewhere this rank computes its
        vocabulary shard (and gets None)."""
        if not len(rows):
            return None
        return self.model.compute_logits(hidden[torch.from_numpy(rows).to(self.device)])

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
        layer_group = [layer_slots.get(i, (0,))[0] for i in range(self.config.num_hidden_layers)]
        return dataclasses.replace(metas[0], groups=metas, layer_group=layer_group)

    # -- rank 0: from logits to tokens --------------------------------------------------------
    def sample(
        self, so: SchedulerOutput, plan: StepPlan, logits: StepLogits | None
    ) -> ModelRunnerOutput:
        """The step's tokens (sample/step_sampler.py), then the drafts proposed for the next."""
        output = self.step_sampler.sample(plan, logits)
        if self.proposer is not None and logits is not None and plan.sample_reqs:
            verified = {
                r.seq_id: len(d) for r, d in zip(plan.sample_reqs, plan.drafts, strict=True)
            }
            output.spec_token_ids = self.proposer.propose(
                plan.sample_reqs, output.sampled_token_ids, verified, len(so.scheduled_requests)
            )
        return output
