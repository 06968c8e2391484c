"""Rank 0's half of a step: from the logits the model computed to what the step produced:
each request's tokens (a token per sample, one per row of a group's first token), drafts
verified, beam candidates, logprobs, prompt logprobs, and embeddings pooled (across chunks). It
keeps what lives across steps: each seeded sample's generator (created on its first token,
carried across steps and preemptions until its request finishes) and the pooling so far of a
prompt computed in chunks. The model runner (worker/model_runner.py) plans the rows
(`StepPlan`) and computes their logits (`StepLogits`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.outputs import ModelRunnerOutput, TokenLogprobs
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler, SamplerOutput, beam_candidates, gather_logprobs
from pagedllm.sequence import Sequence


@dataclass
class StepPlan:
    """Rank 0's side of a step message: who the logits rows belong to."""

    # The requests sampled this step; sample_logits_rows holds one row each, or 1 + k for a
    # request verifying k drafts (`drafts`, aligned: [] for the others).
    sample_reqs: list[Sequence] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    # One per prompt_logits_rows row: the request and the prompt position the row scores.
    prompt_owners: list[tuple[Sequence, int]] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)  # the token at that position
    # Embedding requests this step: (request, its first pooling row, rows, prompt done)
    pooling: list[tuple[Sequence, int, int, bool]] = field(default_factory=list)


@dataclass
class StepLogits:
    """The logits `execute` computed (gathered on rank 0; None where a row set is empty)."""

    prompt: torch.Tensor | None
    sample: torch.Tensor | None
    pooling: torch.Tensor | None = None  # hidden states of the pooling rows (rank 0, float32)


class StepSampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler(seed=seed)
        # Per request id: sample index -> the generator of a seeded sample.
        self.generators: dict[str, dict[int, torch.Generator]] = {}
        # Per embedding request whose prompt is computed in chunks: what is pooled so far (the
        # sum for mean pooling, the first row for CLS).
        self.pooling_state: dict[str, torch.Tensor] = {}

    def forget(self, request_ids) -> None:
        """Finished requests (a new request may reuse a finished one's id in the next step)."""
        for request_id in request_ids:
            self.generators.pop(request_id, None)
            self.pooling_state.pop(request_id, None)

    def forget_all(self) -> None:
        self.generators.clear()
        self.pooling_state.clear()

    def sample(self, plan: StepPlan, logits: StepLogits | None) -> ModelRunnerOutput:
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
        return output

    def _sample_plain(
        self, sample_logits: torch.Tensor, sample_reqs: list[Sequence], output: ModelRunnerOutput
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
    ) -> tuple[torch.Tensor, list[Sequence]]:
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
        row_reqs: list[Sequence],
        sample_indices: list[int],
        output: ModelRunnerOutput,
        keep_generator_states: bool = False,
    ) -> SamplerOutput:
        md = SamplingMetadata.from_requests(
            row_reqs, self.vocab_size, self.device, sample_indices, self.generators
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
        beams: list[Sequence],
        rows: list[int],
        output: ModelRunnerOutput,
    ) -> None:
        md = SamplingMetadata.from_requests(beams, self.vocab_size, self.device)
        k = max(r.group.beam.num_candidates for r in beams)
        k = min(k, logits.shape[1])
        token_ids, logprobs = beam_candidates(logits[torch.tensor(rows, device=self.device)], md, k)
        token_ids, logprobs = token_ids.tolist(), logprobs.tolist()
        for i, r in enumerate(beams):
            n = r.group.beam.num_candidates
            output.beam_candidates[r.seq_id] = (token_ids[i][:n], logprobs[i][:n])
