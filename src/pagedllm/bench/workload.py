"""A seeded synthetic workload shaped like ShareGPT, for offline throughput benchmarks.

ShareGPT conversations (as vLLM's throughput benchmark filters them) average about 161 prompt
tokens and 338 output tokens, with long tails: most requests are short, a few are long. We draw
both lengths from log-normal distributions whose *clipped* means hit those targets exactly (the
location parameter is solved for after clipping), then fill each prompt with token ids drawn
uniformly from the tokenizer's ordinary vocabulary (special tokens excluded). Everything comes
from one numpy seed, so a workload is reproducible across runs and machines.

`scale` shrinks every length (means and clip bounds alike) so the same shape fits a slow machine:
0.25 gives requests a quarter as long.

An Alpaca-shaped workload (`alpaca_like_workload`) is built the same way: the Alpaca instruction
set, as the PagedAttention paper uses it (Fig. 11), averages about 19 prompt tokens and 58 output
tokens. Its lengths are short already, so its default scale is 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

# Means of vLLM's filtered ShareGPT set; the spreads are plausible fits to its long tail.
SHAREGPT_MEAN_INPUT_LEN = 161.0
SHAREGPT_MEAN_OUTPUT_LEN = 338.0
SHAREGPT_SIGMA_INPUT = 1.0
SHAREGPT_SIGMA_OUTPUT = 0.8
MIN_LEN = 4
MAX_INPUT_LEN = 1024  # vLLM's ShareGPT filter drops prompts of 1024 tokens or more
MAX_OUTPUT_LEN = 1024

# The Alpaca dataset as the PagedAttention paper reports it (Fig. 11: mean input 19.31, mean
# output 58.45 tokens); instructions vary little in length, answers more.
ALPACA_MEAN_INPUT_LEN = 19.0
ALPACA_MEAN_OUTPUT_LEN = 58.0
ALPACA_SIGMA_INPUT = 0.5
ALPACA_SIGMA_OUTPUT = 0.8
ALPACA_MAX_INPUT_LEN = 256
ALPACA_MAX_OUTPUT_LEN = 512

WORKLOAD_SHAPES = ("sharegpt", "alpaca")
DEFAULT_SCALES = {"sharegpt": 0.25, "alpaca": 1.0}

# One request: (prompt token ids, number of tokens to generate).
WorkloadRequest = tuple[list[int], int]


@dataclass(frozen=True)
class LengthDistribution:
    """A log-normal length distribution clipped to [min_len, max_len] and rounded to integers."""

    mean: float
    sigma: float
    min_len: int
    max_len: int

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(
                f"need 1 <= min_len <= max_len, got min_len={self.min_len}, max_len={self.max_len}"
            )
        if not self.min_len <= self.mean <= self.max_len:
            raise ValueError(
                f"mean {self.mean} lies outside the clip range [{self.min_len}, {self.max_len}]"
            )
        if self.sigma <= 0:
            raise ValueError(f"sigma must be positive, got {self.sigma}")

    @property
    def mu(self) -> float:
        """The log-normal location whose clipped mean equals `mean` (solved by bisection)."""
        lo, hi = math.log(self.min_len) - 10 * self.sigma, math.log(self.max_len) + 10 * self.sigma
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if clipped_lognormal_mean(mid, self.sigma, self.min_len, self.max_len) < self.mean:
                lo = mid
            else:
                hi = mid
        return 0.5 * (lo + hi)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raw = rng.lognormal(self.mu, self.sigma, size=n)
        return np.clip(np.rint(raw), self.min_len, self.max_len).astype(np.int64)


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def clipped_lognormal_mean(mu: float, sigma: float, lo: float, hi: float) -> float:
    """E[clip(X, lo, hi)] for X ~ LogNormal(mu, sigma)."""
    a, b = math.log(lo), math.log(hi)
    below = _phi((a - mu) / sigma)
    above = 1.0 - _phi((b - mu) / sigma)
    # E[X; lo <= X <= hi] = exp(mu + sigma^2/2) * (Phi((b-mu-s^2)/s) - Phi((a-mu-s^2)/s))
    s2 = sigma * sigma
    inside = math.exp(mu + s2 / 2) * (_phi((b - mu - s2) / sigma) - _phi((a - mu - s2) / sigma))
    return lo * below + hi * above + inside


def _scaled_distributions(
    scale: float,
    means: tuple[float, float],
    sigmas: tuple[float, float],
    max_lens: tuple[int, int],
) -> tuple[LengthDistribution, LengthDistribution]:
    if scale <= 0:
        raise ValueError(f"scale must be positive, got {scale}")
    dists = []
    for mean, sigma, max_len in zip(means, sigmas, max_lens, strict=True):
        hi = max(MIN_LEN, round(max_len * scale))
        dists.append(LengthDistribution(min(max(mean * scale, MIN_LEN), hi), sigma, MIN_LEN, hi))
    return dists[0], dists[1]


def sharegpt_length_distributions(
    scale: float = 1.0,
    max_input_len: int = MAX_INPUT_LEN,
    max_output_len: int = MAX_OUTPUT_LEN,
) -> tuple[LengthDistribution, LengthDistribution]:
    """(input, output) length distributions; `scale` shrinks means and upper bounds alike."""
    return _scaled_distributions(
        scale,
        (SHAREGPT_MEAN_INPUT_LEN, SHAREGPT_MEAN_OUTPUT_LEN),
        (SHAREGPT_SIGMA_INPUT, SHAREGPT_SIGMA_OUTPUT),
        (max_input_len, max_output_len),
    )


def alpaca_length_distributions(
    scale: float = 1.0,
    max_input_len: int = ALPACA_MAX_INPUT_LEN,
    max_output_len: int = ALPACA_MAX_OUTPUT_LEN,
) -> tuple[LengthDistribution, LengthDistribution]:
    """Alpaca's (input, output) length distributions; `scale` as for ShareGPT's."""
    return _scaled_distributions(
        scale,
        (ALPACA_MEAN_INPUT_LEN, ALPACA_MEAN_OUTPUT_LEN),
        (ALPACA_SIGMA_INPUT, ALPACA_SIGMA_OUTPUT),
        (max_input_len, max_output_len),
    )


def normal_token_ids(vocab_size: int, exclude_ids: Iterable[int] = ()) -> np.ndarray:
    """Every id in [0, vocab_size) that is not excluded (special tokens), as an array."""
    ids = np.arange(vocab_size, dtype=np.int64)
    excluded = np.fromiter((i for i in exclude_ids if 0 <= i < vocab_size), dtype=np.int64)
    ids = np.setdiff1d(ids, excluded, assume_unique=False)
    if ids.size == 0:
        raise ValueError("no ordinary token ids left to draw prompts from")
    return ids


def sharegpt_like_workload(
    num_prompts: int,
    vocab_size: int,
    *,
    exclude_ids: Iterable[int] = (),
    scale: float = 0.25,
    seed: int = 0,
    max_input_len: int = MAX_INPUT_LEN,
    max_output_len: int = MAX_OUTPUT_LEN,
    max_model_len: int | None = None,
) -> list[WorkloadRequest]:
    """`num_prompts` requests as (prompt_token_ids, output_len), reproducible from `seed`.

    Lengths and tokens come from independent streams of one seed, so changing the vocabulary
    does not change the lengths. With `max_model_len`, output lengths are cut so that every
    request fits (prompt + output <= max_model_len).
    """
    dists = sharegpt_length_distributions(scale, max_input_len, max_output_len)
    return synthetic_workload(
        num_prompts, vocab_size, dists, exclude_ids=exclude_ids, seed=seed,
        max_model_len=max_model_len,
    )  # fmt: skip


def alpaca_like_workload(
    num_prompts: int,
    vocab_size: int,
    *,
    exclude_ids: Iterable[int] = (),
    scale: float = 1.0,
    seed: int = 0,
    max_model_len: int | None = None,
) -> list[WorkloadRequest]:
    """As `sharegpt_like_workload`, with Alpaca's lengths (about 19 prompt / 58 output tokens)."""
    return synthetic_workload(
        num_prompts, vocab_size, alpaca_length_distributions(scale), exclude_ids=exclude_ids,
        seed=seed, max_model_len=max_model_len,
    )  # fmt: skip


def synthetic_workload(
    num_prompts: int,
    vocab_size: int,
    distributions: tuple[LengthDistribution, LengthDistribution],
    *,
    exclude_ids: Iterable[int] = (),
    seed: int = 0,
    max_model_len: int | None = None,
) -> list[WorkloadRequest]:
    """`num_prompts` requests with lengths from the (input, output) `distributions`, prompt
    tokens drawn uniformly from the ordinary vocabulary; see `sharegpt_like_workload`."""
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    input_dist, output_dist = distributions
    length_seed, token_seed = np.random.SeedSequence(seed).spawn(2)
    length_rng = np.random.default_rng(length_seed)
    token_rng = np.random.default_rng(token_seed)
    input_lens = input_dist.sample(length_rng, num_prompts)
    output_lens = output_dist.sample(length_rng, num_prompts)
    vocab = normal_token_ids(vocab_size, exclude_ids)

    requests: list[WorkloadRequest] = []
    for in_len, out_len in zip(input_lens.tolist(), output_lens.tolist(), strict=True):
        if max_model_len is not None:
            if in_len >= max_model_len:
                in_len = max_model_len - 1
            out_len = max(1, min(out_len, max_model_len - in_len))
        prompt = vocab[token_rng.integers(0, vocab.size, size=in_len)].tolist()
        requests.append((prompt, int(out_len)))
    return requests


def workload_from_tokenizer(
    num_prompts: int,
    tokenizer,
    *,
    vocab_size: int | None = None,
    scale: float | None = None,
    seed: int = 0,
    max_model_len: int | None = None,
    shape: str = "sharegpt",
) -> list[WorkloadRequest]:
    """The workload of `shape` ("sharegpt" or "alpaca") over a pagedllm `Tokenizer` (or any
    object with `vocab_size` and `all_special_ids`); `vocab_size` caps the ids to the model's
    embedding table. `scale` None: the shape's default (0.25 for ShareGPT, 1 for Alpaca)."""
    if shape not in WORKLOAD_SHAPES:
        raise ValueError(f"unknown workload shape {shape!r}; known: {', '.join(WORKLOAD_SHAPES)}")
    size = tokenizer.vocab_size if vocab_size is None else min(vocab_size, tokenizer.vocab_size)
    special = getattr(tokenizer, "all_special_ids", ()) or ()
    make = sharegpt_like_workload if shape == "sharegpt" else alpaca_like_workload
    return make(
        num_prompts,
        size,
        exclude_ids=special,
        scale=DEFAULT_SCALES[shape] if scale is None else scale,
        seed=seed,
        max_model_len=max_model_len,
    )


@dataclass(frozen=True)
class KVSlotUsage:
    """Cache slots reserved vs slots holding a real token."""

    reserved_slots: int
    used_slots: int

    @property
    def used_share(self) -> float:
        return self.used_slots / self.reserved_slots if self.reserved_slots else 0.0

    @property
    def waste_share(self) -> float:
        return 1.0 - self.used_share if self.reserved_slots else 0.0


def static_batch_kv_usage(lengths: Sequence[tuple[int, int]], batch_size: int) -> KVSlotUsage:
    """KV slots of static, left-padded batches (what HF `generate` implies).

    `lengths` holds (prompt_len, output_len) per request, in arrival order; requests are cut into
    batches of `batch_size`. Each batch reserves batch × (longest prompt + longest output) slots
    (every row is padded to the longest prompt and runs until the longest output is done); the
    slots holding real tokens are prompt_len + output_len per request.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    reserved = used = 0
    for start in range(0, len(lengths), batch_size):
        batch = lengths[start : start + batch_size]
        max_prompt = max(p for p, _ in batch)
        max_new = max(o for _, o in batch)
        reserved += len(batch) * (max_prompt + max_new)
        used += sum(p + o for p, o in batch)
    return KVSlotUsage(reserved, used)


def workload_tokenizer(engine):
    """The engine's tokenizer, or (none) a stand-in over every id of the embedding table."""
    if engine.tokenizer is not None:
        return engine.tokenizer
    import types

    return types.SimpleNamespace(vocab_size=engine.model_config.vocab_size, all_special_ids=())
