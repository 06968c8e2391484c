"""The workload of `benchmarks.prefix_caching`: requests that share one prefix.

One common prefix of `prefix_len` tokens, then a short distinct suffix per request (a
sentence-sized log-normal length) and a short output (log-normal), token ids drawn uniformly
from the tokenizer's ordinary vocabulary as in pagedllm.bench.workload; arrivals as a seeded
Poisson process (all at once for an infinite rate). Everything comes from one seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Iterable

import numpy as np

from pagedllm.bench.workload import (
    LengthDistribution,
    WorkloadRequest,
    normal_token_ids,
    workload_tokenizer,
)

# Spread of the suffix and output lengths: log-normal with this sigma, clipped to
# [mean / 4, 4 * mean]. WMT16 sentences average roughly 25 tokens with a moderate spread.
SHORT_LENGTH_SIGMA = 0.5


@dataclasses.dataclass
class SharedPrefixWorkload:
    """Requests that all start with `prefix`; `arrival_offsets[i]` is request i's arrival, in
    seconds after the start (non-decreasing; all 0 for an infinite request rate)."""

    prefix: list[int]
    requests: list[WorkloadRequest]
    arrival_offsets: list[float]

    @property
    def suffix_lens(self) -> list[int]:
        return [len(p) - len(self.prefix) for p, _ in self.requests]

    @property
    def output_lens(self) -> list[int]:
        return [n for _, n in self.requests]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p, _ in self.requests)

    def expected_hit_tokens(self, block_size: int) -> int:
        """Prompt tokens a prefix cache should serve: every request after the first finds the
        prefix's full blocks cached (a block that mixes prefix and suffix tokens cannot hit)."""
        return max(0, len(self.requests) - 1) * (len(self.prefix) // block_size) * block_size


def short_length_distribution(mean: float) -> LengthDistribution:
    """Log-normal lengths of mean `mean` (after clipping to [mean/4, 4*mean], at least 1)."""
    if mean < 1:
        raise ValueError(f"a mean length must be >= 1, got {mean}")
    lo = max(1, math.floor(mean / 4))
    hi = max(lo, math.ceil(mean * 4))
    return LengthDistribution(mean, SHORT_LENGTH_SIGMA, lo, hi)


def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> list[float]:
    """Arrival offsets in seconds: the first at 0, then exponential gaps of mean 1/rate."""
    if not rate > 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    gaps = rng.exponential(1.0 / rate, size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def shared_prefix_workload(
    num_prompts: int,
    vocab_size: int,
    *,
    exclude_ids: Iterable[int] = (),
    prefix_len: int = 341,
    suffix_len: float = 25.0,
    output_len: float = 25.0,
    request_rate: float = math.inf,
    seed: int = 0,
    max_model_len: int | None = None,
) -> SharedPrefixWorkload:
    """`num_prompts` requests sharing one prefix of `prefix_len` tokens, reproducible from `seed`.

    Lengths, tokens and arrivals come from independent streams of one seed, so changing the
    vocabulary or the rate changes nothing else. Suffixes are distinct (redrawn on a repeat). With
    `max_model_len`, suffixes and outputs are cut so that every request fits.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    if max_model_len is not None and prefix_len + 2 > max_model_len:
        raise ValueError(
            f"a {prefix_len}-token prefix leaves no room for a suffix and an output within "
            f"max_model_len {max_model_len}: lower --prefix-len or raise --max-model-len"
        )
    suffix_dist = short_length_distribution(suffix_len)
    output_dist = short_length_distribution(output_len)
    length_seed, token_seed, arrival_seed = np.random.SeedSequence(seed).spawn(3)
    length_rng = np.random.default_rng(length_seed)
    token_rng = np.random.default_rng(token_seed)
    suffix_lens = suffix_dist.sample(length_rng, num_prompts)
    output_lens = output_dist.sample(length_rng, num_prompts)
    arrivals = poisson_arrivals(np.random.default_rng(arrival_seed), num_prompts, request_rate)
    vocab = normal_token_ids(vocab_size, exclude_ids)

    prefix = vocab[token_rng.integers(0, vocab.size, size=prefix_len)].tolist()
    seen: set[tuple[int, ...]] = set()
    requests: list[WorkloadRequest] = []
    for suf_len, out_len in zip(suffix_lens.tolist(), output_lens.tolist(), strict=True):
        if max_model_len is not None:
            suf_len = min(suf_len, max_model_len - 1 - prefix_len)
            out_len = max(1, min(out_len, max_model_len - prefix_len - suf_len))
        for _ in range(100):
            suffix = tuple(vocab[token_rng.integers(0, vocab.size, size=suf_len)].tolist())
            if suffix not in seen:
                break
        else:
            raise ValueError(
                f"cannot draw {num_prompts} distinct suffixes of about {suffix_len} tokens from "
                f"{vocab.size} token ids: raise --suffix-len"
            )
        seen.add(suffix)
        requests.append((prefix + list(suffix), int(out_len)))
    return SharedPrefixWorkload(prefix, requests, arrivals)


def workload_for_engine(ns: argparse.Namespace, engine) -> SharedPrefixWorkload:
    """The workload of the command's flags over the engine's tokenizer (or, without one, every id
    of its embedding table), fitted to its context length."""
    vocab_size = engine.model_config.vocab_size
    tokenizer = workload_tokenizer(engine)
    return shared_prefix_workload(
        ns.num_prompts,
        min(vocab_size, tokenizer.vocab_size),
        exclude_ids=getattr(tokenizer, "all_special_ids", ()) or (),
        prefix_len=ns.prefix_len,
        suffix_len=ns.suffix_len,
        output_len=ns.output_len,
        request_rate=ns.request_rate,
        seed=ns.workload_seed,
        max_model_len=engine.max_model_len,
    )
