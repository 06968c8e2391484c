"""The scenarios `benchmarks.peers` runs on both servers after the ShareGPT-shaped sweep: the
shapes where a CPU engine's prompt processing shows, which short chats hide.

- long-prompts: `--long-prompt-len`-token prompts (1,536 by default) answered with 64 tokens,
  4 in flight: output tokens/s, where prefill dominates;
- shared-prefix: 32 requests sharing a `--prefix-len`-token prefix (400), a short distinct
  suffix and output each (benchmarks/prefix_workload.py), 8 in flight: output tokens/s, where a
  prefix cache pays;
- prefill: one prompt alone of each of `--prefill-lens` (512 and 2,048), max_tokens=1, three
  distinct prompts each: prompt tokens/s = prompt tokens / time to first token (median).

Token ids are drawn from the tokenizer's ordinary vocabulary, distinct per request, so no
cache of either server can skip work except the shared prefix's.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from benchmarks import common
from benchmarks.prefix_workload import shared_prefix_workload
from pagedllm.bench.workload import WorkloadRequest

SCENARIOS = ("long-prompts", "shared-prefix", "prefill")
LONG_PROMPTS, LONG_OUTPUT_LEN, LONG_CONCURRENCY = 8, 64, 4
PREFIX_PROMPTS, PREFIX_CONCURRENCY = 32, 8
PREFILL_REPEATS = 3


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str  # the report's key
    label: str  # the table's row
    requests: list[WorkloadRequest]
    concurrency: int
    prefill: bool = False  # True: one request at a time, rated by prompt tokens / TTFT


def _scenario_list(text: str) -> list[str]:
    return [] if text.strip() == "none" else common.choice_list(SCENARIOS, "scenarios")(text)


def add_cli_args(group) -> None:
    group.add_argument("--scenarios", type=_scenario_list, default=list(SCENARIOS),
                       help="after the sweep: a subset of long-prompts,shared-prefix,prefill, "
                            "or none (default: all)")  # fmt: skip
    group.add_argument(
        "--long-prompt-len",
        type=int,
        default=1536,
        help="the long-prompts scenario's prompt tokens (default: 1536)",
    )
    group.add_argument(
        "--prefix-len",
        type=int,
        default=400,
        help="the shared-prefix scenario's prefix (default: 400)",
    )
    group.add_argument(
        "--prefill-lens",
        type=common.int_list,
        default=[512, 2048],
        help="the prefill scenario's prompt lengths (default: 512,2048)",
    )


def build(ns, ordinary: np.ndarray, special: set[int], vocab_size: int, max_model_len: int,
          seed: int) -> tuple[list[Scenario], list[str]]:  # fmt: skip
    """The chosen scenarios, and a note for each one dropped because it does not fit within
    max_model_len."""
    rng = np.random.default_rng(seed + 2)
    scenarios, notes = [], []

    def prompt(n: int) -> list[int]:
        return rng.choice(ordinary, n).tolist()

    if "long-prompts" in ns.scenarios:
        n = ns.long_prompt_len
        if n + LONG_OUTPUT_LEN > max_model_len:
            notes.append(f"long-prompts: {n} + {LONG_OUTPUT_LEN} tokens > {max_model_len}")
        else:
            requests = [(prompt(n), LONG_OUTPUT_LEN) for _ in range(LONG_PROMPTS)]
            label = f"{n}-token prompts, {LONG_OUTPUT_LEN} out, concurrency {LONG_CONCURRENCY}"
            scenarios.append(Scenario("long-prompts", label, requests, LONG_CONCURRENCY))
    if "shared-prefix" in ns.scenarios:
        try:
            workload = shared_prefix_workload(
                PREFIX_PROMPTS, vocab_size, exclude_ids=special, prefix_len=ns.prefix_len,
                seed=seed + 3, max_model_len=max_model_len,
            )  # fmt: skip
        except ValueError as e:
            notes.append(f"shared-prefix: {e}")
        else:
            label = f"{ns.prefix_len}-token shared prefix, concurrency {PREFIX_CONCURRENCY}"
            scenarios.append(
                Scenario("shared-prefix", label, workload.requests, PREFIX_CONCURRENCY)
            )
    if "prefill" in ns.scenarios:
        for n in ns.prefill_lens:
            if n + 1 > max_model_len:
                notes.append(f"prefill: {n} + 1 tokens > {max_model_len}")
                continue
            requests = [(prompt(n), 1) for _ in range(PREFILL_REPEATS)]
            label = f"prefill {n} tokens (prompt tokens/s)"
            scenarios.append(Scenario(f"prefill-{n}", label, requests, 1, prefill=True))
    return scenarios, notes
