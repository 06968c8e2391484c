"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache, samples.

A step has three parts, so that every rank of a tensor-parallel group runs the same message:
`prepare_inputs` (rank 0) makes the step message (distributed/step_channel.py: block moves,
token ids, positions, block tables, the rows whose logits are needed) and a plan of what to do
with the logits; `execute` (every rank) moves blocks, runs the forward pass and the LM head;
`sample` (rank 0) draws tokens, beam candidates and logprobs. The runner also owns each
request's device state: the seeded generators of its samples, dropped when it finishes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.selector import get_attention_backend
from pagedllm.config import ModelArchConfig
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.distributed.step_channel import StepInputs, pairs
from pagedllm.outputs import ModelRunnerOutput, TokenLogprobs
from pagedllm.request import Request
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler, SamplerOutput, beam_candidates, gather_logprobs
from pagedllm.spec_decode import Proposer
from pagedllm.worker.kv_cache import KVCache, kv_cache_spec
from pagedllm.worker.lora_manager import LoRAManager


@dataclass
class StepPlan:
    """Rank 0's side of a step message: who the logits rows belong to."""

    # The requests sampled this step; sample_logits_rows holds one row each, or 1 + k for a
    # request verifying k drafts (`drafts`, aligned: [] for the others).
    sample_reqs: list[Request] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    # One per prompt_logits_rows row: the request and the prompt position the row scores.
    prompt_owners: list[tuple[Request, int]] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)  # the token at that position
    # Embedding requests this step: (request, its first pooling row, rows, prompt done)
    pooling: list[tuple[Request, int, int, bool]] = field(default_factory=list)


@dataclass
class StepLogits:
    """The logits `execute` computed (gathered on rank 0; None where a row set is empty)."""

    prompt: torch.Tensor | None
    sample: torch.Tensor | None
    pooling: torch.Tensor | None = None  # hidden states of the pooling rows (rank 0, float32)


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
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = device
        self.cache_dtype = cache_dtype  # the KV pool's elements (attention/kv_quant.py)
        self.kv_cache_spec = kv_cache_spec(config, block_size, cache_dtype)
        self.sampler = Sampler(seed=seed)
        # Speculative decoding: proposes each sampled request's drafts for the next step.
        self.proposer = proposer
        self.lora = lora  # the model's LoRA slots (--enable-lora)
        # Per request id: sample index -> the generator of a seeded sample, created on its first
        # token and carried across steps (and preemptions) until the request finishes.
        self.generators: dict[str, dict[int, torch.Generator]] = {}
        # Per embedding request whose prompt is computed in chunks: what is pooled so far (the
        # sum for mean pooling, the first row for CLS).
        self.pooling_state: dict[str, torch.Tensor] = {}
        self.kv_cache: KVCache | None = None
        # Block copies (copy-on-write, swap) run on the attention backend's kernels.
        self._copy_blocks = get_attention_backend(attention_backend, device).copy_blocks

    def forget_requests(self) -> None:
        """Drop every request's state (another engine takes this runner over)."""
        self.generators.clear()
        self.pooling_state.clear()
        if self.proposer is not None:
            self.proposer.reset()

    def initialize_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        self.kv_cache = None  # the old pool goes before the new one is allocated
        self.kv_cache = KVCache(
            self.kv_cache_spec, self.config.num_hidden_layers, num_blocks, num_cpu_blocks,
            self.cache_dtype, self.device, self._copy_blocks,
        )  # fmt: skip

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
        hidden = self.model(input_ids, torch.arange(num_tokens, device=dev), cache.layers, meta)
        self.model.compute_logits(hidden[: min(num_logits, num_tokens)])

    # -- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, send=None) -> ModelRunnerOutput:
        """The whole step on rank 0; `send` hands the step message to the other ranks first."""
        step, plan = self.prepare_inputs(so)
        if send is not None:
            send(step)
        return self.sample(so, plan, self.execute(step))

    def prepare_inputs(self, so: SchedulerOutput) -> tuple[StepInputs, StepPlan]:
        """The step as host arrays (what the other ranks of a tensor-parallel group receive)
        and the plan for its logits. Finished requests' generators are dropped first: a new
        request may reuse a finished one's id in this very step."""
        for request_id in so.finished_request_ids:
            self.generators.pop(request_id, None)
            self.pooling_state.pop(request_id, None)
        if self.proposer is not None and so.finished_request_ids:
            self.proposer.finish(so.finished_request_ids)
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
        return step, plan

    def _plan_lora(self, reqs: list[Request], num_scheduled: np.ndarray, step: StepInputs):
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
        try:
            hidden = self.model(input_ids, positions, kv.layers, meta)
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
        layer_group = [layer_slots[i][0] for i in range(self.config.num_hidden_layers)]
        return dataclasses.replace(metas[0], groups=metas, layer_group=layer_group)

    # -- rank 0: from logits to tokens --------------------------------------------------------
    def sample(
        self, so: SchedulerOutput, plan: StepPlan, logits: StepLogits | None
    ) -> ModelRunnerOutput:
        output = ModelRunnerOutput({})
        if logits is None:
            return output
        if plan.pooling:
            self._pool(logits.pooling, plan, output)
        if logits.prompt is not None:
            self._prompt_logprobs(logits.prompt, plan, output)
        if not plan.sample_reqs:
            return output
        sample_logits, sample_reqs = logits.sample, plan.sample_reqs
        if any(plan.drafts):
            sample_logits, sample_reqs = self._verify(sample_logits, plan, output)
        self._sample_plain(sample_logits, sample_reqs, output)
        if self.proposer is not None:
            verified = {
                r.seq_id: len(d) for r, d in zip(plan.sample_reqs, plan.drafts, strict=True)
            }
            output.spec_token_ids = self.proposer.propose(
                plan.sample_reqs, output.sampled_token_ids, verified, len(so.scheduled_requests)
            )
        return output

    def _sample_plain(
        self, sample_logits: torch.Tensor, sample_reqs: list[Request], output: ModelRunnerOutput
    ) -> None:
        """One row per request: beam candidates, or a token per sample."""
        if not sample_reqs:
            return
        beam_rows = [i for i, r in enumerate(sample_reqs) if r.group.is_beam_search]
        if beam_rows:
            beams = [sample_reqs[i] for i in beam_rows]
            self._beam_candidates(sample_logits, beams, beam_rows, output)
            if len(beam_rows) == len(sample_reqs):
                return
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
            sample_logits = sample_logits[torch.tensor(rows, device=self.device)]  # and forks in
        self._sample(sample_logits, row_reqs, sample_indices, output)

    def _verify(
        self, logits: torch.Tensor, plan: StepPlan, output: ModelRunnerOutput
    ) -> tuple[torch.Tensor, list[Request]]:
        """The requests that verify drafts: each of their rows is sampled as if the drafts
        before it were accepted, and the drafts are kept while they equal what was sampled;
        the first sample that differs (or the one after the last draft) is the step's last
        token. With a draft of one token, that is Leviathan et al.'s rejection sampling (a
        draft token is accepted with its probability under the target, and a rejection
        samples the target's distribution without it), so the output is distributed as
        without drafts, and a seeded request's generator, set back to the row it kept, gives
        the very tokens it would give without. Returns the other rows and requests."""
        rows, views, indices, plain_rows, plain_reqs = [], [], [], [], []
        row = 0
        for r, drafts in zip(plan.sample_reqs, plan.drafts, strict=True):
            if not drafts:
                plain_rows.append(row)
                plain_reqs.append(r)
                row += 1
                continue
            for j in range(len(drafts) + 1):
                views.append(r.with_drafts(drafts[:j]))
            indices += [r.sample_index] * (len(drafts) + 1)
            rows += range(row, row + len(drafts) + 1)
            row += len(drafts) + 1
        out = self._sample(logits[torch.tensor(rows, dtype=torch.long, device=self.device)], views,
                           indices, output,
                           keep_generator_states=True)  # fmt: skip
        start = 0
        for r, drafts in zip(plan.sample_reqs, plan.drafts, strict=True):
            if not drafts:
                continue
            tokens = output.sampled_token_ids[r.seq_id]
            num_accepted = 0
            while num_accepted < len(drafts) and tokens[num_accepted] == drafts[num_accepted]:
                num_accepted += 1
            del tokens[num_accepted + 1 :]
            if r.seq_id in output.logprobs:
                del output.logprobs[r.seq_id][num_accepted + 1 :]
            state = (out.generator_states or {}).get(start + num_accepted)
            if state is not None:
                self.generators[r.request_id][r.sample_index].set_state(state)
            start += len(drafts) + 1
        plain_logits = logits[torch.tensor(plain_rows, dtype=torch.long, device=self.device)]
        return plain_logits, plain_reqs

    def _pool(self, hidden: torch.Tensor | None, plan: StepPlan, output: ModelRunnerOutput):
        """Each embedding request's rows into its pooled vector, finished when its prompt is."""
        for r, first, count, done in plan.pooling:
            rows = hidden[first : first + count] if count else None
            kind, state = r.pooling_params.pooling_type, self.pooling_state
            if rows is not None and kind == "MEAN":
                # A chunk at position 0 starts over (a recomputed prompt)
                total = rows.sum(0)
                if r.num_computed_tokens and r.request_id in state:
                    total = state[r.request_id] + total
                state[r.request_id] = total
            elif rows is not None:
                state[r.request_id] = rows[0]
            if not done:
                continue
            vector = state.pop(r.request_id)
            if kind == "MEAN":
                vector = vector / r.num_prompt_tokens
            params = r.pooling_params
            if params.dimensions is not None:
                vector = vector[: params.dimensions]
            if params.normalize:
                vector = torch.nn.functional.normalize(vector, dim=-1)
            output.pooled[r.seq_id] = vector.cpu()

    def _prompt_logprobs(
        self, logits: torch.Tensor, plan: StepPlan, output: ModelRunnerOutput
    ) -> None:
        """The raw logprob, rank and top-k of every prompt token the step scored."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        owners = plan.prompt_owners
        k = max(r.sampling_params.prompt_logprobs for r, _ in owners)
        targets = torch.tensor(plan.prompt_targets, device=self.device)
        ids, lps, ranks = gather_logprobs(logprobs, k, targets)
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
        keep_generator_states: bool = False,
    ) -> SamplerOutput:
        md = SamplingMetadata.from_requests(
            row_reqs, self.config.vocab_size, self.device, sample_indices, self.generators
        )
        md.keep_generator_states = keep_generator_states
        out = self.sampler(logits, md)
        token_ids = out.sampled_token_ids.tolist()
        for r, t in zip(row_reqs, token_ids, strict=True):
            output.sampled_token_ids.setdefault(r.seq_id, []).append(t)
        if out.logprobs is None:
            return out
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
        return out

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
