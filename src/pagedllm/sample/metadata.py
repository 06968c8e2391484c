"""Per-step sampling tensors, one row per request being sampled."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from pagedllm.sample import grammar_mask
from pagedllm.sequence import Sequence


@dataclass
class SamplingMetadata:
    # Fields a step does not need are None, so the sampler skips that work entirely.
    temperature: torch.Tensor | None  # [rows] float32; 1.0 on greedy rows; None if all greedy
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None  # [rows] bool; only for batches mixing greedy and random
    top_k: torch.Tensor | None  # [rows] int64; vocab_size where disabled
    top_p: torch.Tensor | None  # [rows] float32; 1.0 where disabled
    min_p: torch.Tensor | None  # [rows] float32; 0.0 where disabled
    # Seeded random rows: row -> the generator of that sample (seeded with seed + sample index).
    generators: dict[int, torch.Generator]
    # Penalties: [rows] float32 each, plus flat (row, token id) pairs of the tokens seen.
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    prompt_tokens: tuple[torch.Tensor, torch.Tensor] | None  # rows with repetition penalty only
    output_tokens: tuple[torch.Tensor, torch.Tensor] | None
    # (rows, token ids) to set to -inf: EOS/stop ids of requests still under min_tokens.
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None
    # (rows, token ids, bias) added to the logits.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # Structured outputs: (rows, bitmask [rows, vocab / 32] int32) of the constrained rows; their
    # disallowed tokens are set to -inf before anything else.
    grammar_bitmask: tuple[torch.Tensor, torch.Tensor] | None
    max_num_logprobs: int | None  # None: no row wants logprobs
    # Per row: top logprobs to report (0: only the sampled token's), or None for none.
    num_logprobs: list[int | None]
    # Report each seeded row's generator state after its draw (speculative decoding rewinds
    # a generator to the last row it keeps).
    keep_generator_states: bool = False

    @property
    def no_penalties(self) -> bool:
        return self.repetition_penalties is None

    @classmethod
    def from_requests(
        cls,
        requests: list[Sequence],
        vocab_size: int,
        device: torch.device | str,
        sample_indices: list[int] | None = None,
        generators: dict[str, dict[int, torch.Generator]] | None = None,
    ) -> SamplingMetadata:
        """One row per (request, sample index): a sequence group's first token repeats its
        sequence once per sample, each drawing from its own seeded generator. `generators`
        (request id -> sample index -> generator: the caller's, kept across steps) gets the
        generators of seeded samples drawing for the first time."""
        if generators is None:
            generators = {}
        if sample_indices is None:
            sample_indices = [r.sample_index for r in requests]
        params = [r.sampling_params for r in requests]
        greedy = [p.is_greedy for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        temperature = greedy_mask = top_k = top_p = min_p = None
        row_generators: dict[int, torch.Generator] = {}
        if not all_greedy:
            # Greedy rows get neutral values so the random path does no harm (or work) there.
            rand = [None if g else p for p, g in zip(params, greedy, strict=True)]
            temperature = floats([p.temperature if p else 1.0 for p in rand])
            if not all_random:
                greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=device)
            ks = [p.top_k if p and 0 < p.top_k < vocab_size else vocab_size for p in rand]
            if any(k != vocab_size for k in ks):
                top_k = longs(ks)
            if any(p and p.top_p < 1.0 for p in rand):
                top_p = floats([p.top_p if p else 1.0 for p in rand])
            if any(p and p.min_p > 0.0 for p in rand):
                min_p = floats([p.min_p if p else 0.0 for p in rand])
            for i, p in enumerate(rand):
                if p is None or p.seed is None:
                    continue
                # Created once per sample and kept by the caller so the stream continues across
                # steps; sample i is seeded with seed + i, like n independent requests.
                request_generators = generators.setdefault(requests[i].request_id, {})
                index = sample_indices[i]
                if index not in request_generators:
                    gen = torch.Generator(device=device)
                    gen.manual_seed(p.seed + index)
                    # A sequence resumed from a lost engine drew once per output token there:
                    # its stream goes on where that one was (the sampler's draw per row).
                    skip = torch.empty(vocab_size, dtype=torch.float32, device=device)
                    for _ in range(requests[i].num_output_tokens):
                        skip.exponential_(generator=gen)
                    request_generators[index] = gen
                row_generators[i] = request_generators[index]

        def pairs(rows: list[int], ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
            # Flat (row, token) pairs, built in numpy: much faster than torch.tensor on long
            # Python lists, and cheaper than a padded [rows, max_len] tensor.
            tokens = np.fromiter(chain.from_iterable(ids), dtype=np.int64)
            row_ids = np.repeat(np.asarray(rows, dtype=np.int64), [len(x) for x in ids])
            if tokens.size and tokens.max() >= vocab_size:
                keep = tokens < vocab_size  # a tokenizer may know ids the model's vocab lacks
                tokens, row_ids = tokens[keep], row_ids[keep]
            return torch.from_numpy(row_ids).to(device), torch.from_numpy(tokens).to(device)

        presence = frequency = repetition = prompt_tokens = output_tokens = None
        penalized = [
            i
            for i, p in enumerate(params)
            if p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0
            or p.repetition_penalty != 1.0
        ]
        if penalized:
            presence = floats([p.presence_penalty for p in params])
            frequency = floats([p.frequency_penalty for p in params])
            repetition = floats([p.repetition_penalty for p in params])
            # Only penalized rows pay for building their token lists.
            output_tokens = pairs(penalized, [requests[i].output_token_ids for i in penalized])
            rep_rows = [i for i in penalized if params[i].repetition_penalty != 1.0]
            if rep_rows:
                prompt_tokens = pairs(rep_rows, [requests[i].prompt_token_ids for i in rep_rows])

        mask_rows: list[int] = []
        mask_ids: list[int] = []
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        for i, r in enumerate(requests):
            p = r.sampling_params
            ids = set()
            if r.num_output_tokens < p.min_tokens:
                ids.update(p.stop_token_ids)
                if not p.ignore_eos:
                    ids.update(r.eos_token_ids)
            if p.ignore_eos and r.grammar is not None:
                ids.update(r.eos_token_ids)  # the grammar would take EOS as its end
            if ids:
                ids = [t for t in ids if t < vocab_size]
                mask_rows += [i] * len(ids)
                mask_ids += ids
            if p.logit_bias:
                # Ids outside the vocab are ignored; the engine should reject them on admission.
                items = [(t, b) for t, b in p.logit_bias.items() if 0 <= t < vocab_size]
                bias_rows += [i] * len(items)
                bias_ids += [t for t, _ in items]
                bias_values += [b for _, b in items]

        grammar_bitmask = None
        grammar_rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if grammar_rows:
            grammars = [requests[i].grammar for i in grammar_rows]
            grammar_bitmask = (longs(grammar_rows), grammar_mask.grammar_bitmask(grammars))

        # best_of > n ranks samples by cumulative logprob, so it needs the sampled token's.
        num_logprobs = [
            p.logprobs if p.logprobs is not None else (0 if p.num_sequences > p.n else None)
            for p in params
        ]
        logprobs = [k for k in num_logprobs if k is not None]
        return cls(
            temperature=temperature,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=greedy_mask,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators=row_generators,
            presence_penalties=presence,
            frequency_penalties=frequency,
            repetition_penalties=repetition,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            min_tokens_mask=(longs(mask_rows), longs(mask_ids)) if mask_rows else None,
            logit_bias=(longs(bias_rows), longs(bias_ids), floats(bias_values))
            if bias_rows
            else None,
            grammar_bitmask=grammar_bitmask,
            max_num_logprobs=max(logprobs) if logprobs else None,
            num_logprobs=num_logprobs,
        )
