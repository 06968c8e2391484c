"""`python -m benchmarks.embeddings --model PATH`: embeddings per second of the pooling runner
against sentence-transformers on the same model files, in this process, the same texts.

`--num-texts` sentences of 8-60 words (a fixed mix) are embedded `--repeat` times by each, in
turn (interleaved rounds, the median kept: this machine's speed drifts between runs): pagedllm
through `LLM.embed` (all texts at once, the scheduler batching them under its token budget) and
sentence-transformers' `encode` (`--st-batch-size`, its default 32, padded batches). Both in
float32 unless --dtype says otherwise for pagedllm (sentence-transformers runs float32). The
embeddings of the two must agree (cosine, printed)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks import common
from pagedllm.bench.utils import cpu_counters, others_cpu_share
from pagedllm.config import EngineArgs
from pagedllm.cpu_info import has_native_bf16

WORDS = ("the paged cache keeps keys and values in fixed blocks that a table maps so memory is "
         "never fragmented and requests share their prefixes while the scheduler batches every "
         "step").split()  # fmt: skip


def texts(n: int) -> list[str]:
    """n sentences of 8 to 60 words, a fixed mix."""
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(8 + (i * 13) % 53))
            for i in range(n)]  # fmt: skip


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument("--num-texts", type=int, default=512)
    group.add_argument("--repeat", type=int, default=3, help="interleaved rounds (median kept)")
    group.add_argument("--st-batch-size", type=int, default=32)


def main(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    from sentence_transformers import SentenceTransformer

    from pagedllm import LLM

    if engine_args.dtype == "auto":
        engine_args.dtype = "float32"  # as sentence-transformers runs
    args = {k: getattr(engine_args, k) for k in EngineArgs.field_names()}
    llm = LLM(**args)
    st = SentenceTransformer(engine_args.model, device="cpu")
    batch = texts(ns.num_texts)
    num_tokens = sum(len(llm.get_tokenizer().encode(t)) for t in batch)
    llm.embed(batch[:8], use_tqdm=False)  # warm-up
    st.encode(batch[:8])
    ours, theirs, got, ref = [], [], None, None
    cpu_before = cpu_counters()
    for _ in range(ns.repeat):
        start = time.perf_counter()
        got = torch.stack([o.outputs.data for o in llm.embed(batch, use_tqdm=False)])
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        ref = st.encode(batch, batch_size=ns.st_batch_size, convert_to_tensor=True,
                        normalize_embeddings=True)  # fmt: skip
        theirs.append(time.perf_counter() - start)
    cosine = torch.nn.functional.cosine_similarity(got, ref.float().to(got.device), dim=-1)
    a, b = statistics.median(ours), statistics.median(theirs)
    engine, threads = llm.llm_engine, torch.get_num_threads()
    others = others_cpu_share(cpu_before, cpu_counters())
    print(f"embeddings: {ns.num_texts} texts ({num_tokens} tokens), model {engine.model_name}, "
          f"pagedllm {engine.config.model.dtype}, torch threads {threads}, bf16 instructions: "
          f"{'yes' if has_native_bf16() else 'no'}, other processes' CPU share: "
          f"{'n/a' if others is None else f'{others:.0%}'}")  # fmt: skip
    print(f"pagedllm               {ns.num_texts / a:8.1f} texts/s  {num_tokens / a:9.0f} tokens/s")
    print(f"sentence-transformers  {ns.num_texts / b:8.1f} texts/s  {num_tokens / b:9.0f} tokens/s"
          f"  (batch {ns.st_batch_size})")  # fmt: skip
    rounds = ", ".join(f"{t / o:.2f}" for o, t in zip(ours, theirs, strict=True))
    print(f"ratio {b / a:.2f}x (rounds: {rounds}); cosine min {cosine.min().item():.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main))
