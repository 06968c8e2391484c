"""`python -m benchmarks.structured`: what grammar-constrained requests cost a batch.

One engine runs the same batch of `--num-seqs` greedy chat requests (`--output-len` tokens each,
EOS ignored) three times: all unconstrained; then with half of them constrained by a regex that
never completes (`[a-z ]+`: every request still decodes `--output-len` tokens, so the batch keeps
its shape); then with half constrained by a JSON schema (an array of short strings, which may
end early). Reported per run: decode throughput, step time, and the time spent computing and
applying the grammar masks (measured around those calls). The unconstrained half must decode
exactly the same tokens in every run: a constrained neighbour does not change them.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager

from benchmarks import common
from pagedllm.config import EngineArgs
from pagedllm.sample import grammar_mask
from pagedllm.sample import sampler as sampler_module
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

QUESTIONS = [
    "Tell me about the sea.", "What is a block table?", "Describe a forest in autumn.",
    "Explain how a bicycle works.", "Write about your favourite city.", "What do cats like?",
    "How are mountains formed?", "Describe a busy market.",
]  # fmt: skip
JSON_SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 64}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument("--num-seqs", type=int, default=16, help="requests in the batch")
    group.add_argument("--output-len", type=int, default=64, help="tokens per request")


@contextmanager
def _timed(module, name: str, totals: dict[str, float]):
    """Add the time spent in module.name to totals[name] while inside."""
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - start

    setattr(module, name, wrapper)
    try:
        yield
    finally:
        setattr(module, name, original)


def run_batch(engine, prompts: list[dict], params: list[SamplingParams]) -> dict:
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    totals: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    steps = 0
    start = time.perf_counter()
    with (
        _timed(grammar_mask, "grammar_bitmask", totals),
        _timed(sampler_module, "apply_grammar_bitmask", totals),
    ):
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
            steps += 1
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "steps": steps,
        "tokens": [tokens[str(i)] for i in range(len(prompts))],
        "mask_seconds": sum(totals.values()),
    }


def main(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    from pagedllm.engine.llm_engine import LLMEngine

    engine_args.enable_prefix_caching = False  # every run prefills alike
    engine = LLMEngine(engine_args)
    tokenizer = engine.tokenizer
    prompts = []
    for i in range(ns.num_seqs):
        chat = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
        prompts.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
    free = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)

    def constrained(**kind) -> SamplingParams:
        return SamplingParams(
            temperature=0,
            max_tokens=ns.output_len,
            ignore_eos=True,
            structured_outputs=StructuredOutputsParams(**kind),
        )

    half = ns.num_seqs // 2
    runs = {
        "all unconstrained": [free] * ns.num_seqs,
        f"{ns.num_seqs - half} of {ns.num_seqs} regex": [free] * half
        + [constrained(regex="[a-z ]+")] * (ns.num_seqs - half),
        f"{ns.num_seqs - half} of {ns.num_seqs} json": [free] * half
        + [constrained(json=JSON_SCHEMA)] * (ns.num_seqs - half),
    }
    run_batch(engine, prompts[:2], [free] * 2)  # warm-up
    print(
        f"structured outputs: {ns.num_seqs} greedy requests x {ns.output_len} tokens, "
        f"model {engine.model_name}"
    )
    print(f"{'run':<22} {'tokens':>7} {'tok/s':>8} {'step ms':>8} {'mask ms/step':>13}")
    results = {}
    for name, params in runs.items():
        r = results[name] = run_batch(engine, prompts, params)
        num_tokens = sum(len(t) for t in r["tokens"])
        print(
            f"{name:<22} {num_tokens:>7} {num_tokens / r['seconds']:>8.1f} "
            f"{r['seconds'] / r['steps'] * 1e3:>8.2f} {r['mask_seconds'] / r['steps'] * 1e3:>13.3f}"
        )
    baseline = results["all unconstrained"]["tokens"][:half]
    same = all(r["tokens"][:half] == baseline for r in results.values())
    print(f"unconstrained requests decode the same tokens in every run: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main))
