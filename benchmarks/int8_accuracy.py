"""`python -m benchmarks.int8_accuracy`: the default path's accuracy against transformers' float32.

A quantized GGUF's products run on its codes with 8-bit activations by default (docs/numerics.md),
so they cannot be token-exact against transformers' float32; they are bounded instead,
teacher-forced: transformers' float32 model on the same file writes a greedy continuation of
each question, then pagedllm's default scores prompt + continuation in one prefill
(prompt_logprobs). Reported over the continuations' positions: top-1 agreement (pagedllm's most
likely token is transformers' greedy token) and the mean |delta logprob| of transformers' token,
for the engine and for a simulation of its arithmetic (transformers' float32 model with every
linear layer's input quantized per block of 32 as the kernels do, scale = max|x| / 127).

Rounding activations to 8 bits is discontinuous: a last-bit difference upstream moves a code by
one step now and then, and over many layers two runs become different draws of the same
quantization noise. With 288 positions one position is 0.35 points of agreement; more questions
(`--num-questions`, the first six are tests/engine/test_int8_act_accuracy.py's) narrow it.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from benchmarks import common

NUM_TOKENS = 48
QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is to a child, with an example.",
    "List three prime numbers.",
    "Describe how a bicycle works.",
    "Give me a recipe for pancakes.",
]
# Questions past the first six: one shape, varied subjects.
TOPICS = (
    "the moon", "a volcano", "photosynthesis", "the stock market", "a violin", "rain",
    "the French revolution", "black holes", "bread", "a computer's memory", "bees",
    "the ocean tides", "chess", "a bridge", "vaccines", "the internet", "glaciers", "a camera",
    "democracy", "coffee", "earthquakes", "the alphabet", "a car engine", "friendship",
)  # fmt: skip


def questions(n: int) -> list[str]:
    extra = [f"Tell me something interesting about {t}." for t in TOPICS]
    if n > len(QUESTIONS) + len(extra):
        raise ValueError(f"--num-questions: at most {len(QUESTIONS) + len(extra)}")
    return (QUESTIONS + extra)[:n]


def quantize_like_the_kernels(x: torch.Tensor) -> torch.Tensor:
    """x with every row's blocks of 32 as their 8-bit codes times the block's scale."""
    shape = x.shape
    blocks = x.float().reshape(-1, shape[-1] // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, 0.0, 1 / d)
    q = torch.round(blocks * inv).clamp(-127, 127)
    return (q * d).reshape(shape).to(x.dtype)


def load_transformers(model: str | None):
    """transformers' float32 model of the GGUF `model` (None: the default) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm.model_loader import resolve_model

    path = resolve_model(model)
    directory = os.path.dirname(path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=path)
    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=path, dtype=torch.float32)
    return hf.eval(), tokenizer


def greedy_continuations(
    model, prompts: list[list[int]], num_tokens: int = NUM_TOKENS
) -> list[tuple[int, list[int]]]:
    """(prompt length, prompt + transformers' greedy continuation of num_tokens) of each."""
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.inference_mode():
            gen = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=num_tokens,
                min_new_tokens=num_tokens, do_sample=False,
            )  # fmt: skip
        out.append((len(ids), gen[0].tolist()))
    return out


def log_softmax_of(model, seq: list[int], quantize_inputs: bool) -> torch.Tensor:
    hooks = []
    if quantize_inputs:
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                hooks.append(
                    m.register_forward_pre_hook(lambda _, a: (quantize_like_the_kernels(a[0]),))
                )
    try:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), dim=-1)
    finally:
        for h in hooks:
            h.remove()


def teacher_forced(llm, sequences, model, quantize_inputs: bool = True):
    """(top-1 agreement, mean |delta logprob|) over the continuations' positions against
    transformers' float32: of llm's prompt logprobs, or without llm (None) of the simulation's."""
    from pagedllm import SamplingParams

    if llm is not None:
        params = SamplingParams(max_tokens=1, prompt_logprobs=1)
        prompts = [{"prompt_token_ids": s} for _, s in sequences]
        outs = llm.generate(prompts, params, use_tqdm=False)
    deltas, agree = [], []
    for i, (prompt_len, seq) in enumerate(sequences):
        ref = log_softmax_of(model, seq, quantize_inputs=False)
        sim = None if llm is not None else log_softmax_of(model, seq, quantize_inputs)
        for pos in range(prompt_len, len(seq)):
            if sim is None:
                logprobs = outs[i].prompt_logprobs[pos]
                lp = logprobs[seq[pos]].logprob
                top = next(t for t, p in logprobs.items() if p.rank == 1)
            else:
                lp, top = sim[pos - 1, seq[pos]].item(), int(sim[pos - 1].argmax())
            deltas.append(abs(lp - ref[pos - 1, seq[pos]].item()))
            agree.append(top == int(ref[pos - 1].argmax()))
    return sum(agree) / len(agree), sum(deltas) / len(deltas)


def prompt_ids(model_name: str | None, tokenizer, qs: list[str]) -> list[list[int]]:
    """Each question as a one-turn chat prompt (Gemma 3's turn format for gemma3 models)."""
    if model_name and "gemma" in model_name:
        turns = [f"<start_of_turn>user\n{q}<end_of_turn>\n<start_of_turn>model\n" for q in qs]
        return [tokenizer(t)["input_ids"] for t in turns]
    out = []
    for q in qs:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
            return_dict=False,
        )  # fmt: skip
        out.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    return out


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument("--model", default=None, help="a GGUF file or a packaged model's name")
    group.add_argument("--num-questions", type=int, default=30,
                       help=f"questions, {NUM_TOKENS} scored tokens each (default 30)")  # fmt: skip


def main(ns: argparse.Namespace) -> int:
    from pagedllm import LLM

    model, tokenizer = load_transformers(ns.model)
    sequences = greedy_continuations(
        model, prompt_ids(ns.model, tokenizer, questions(ns.num_questions))
    )
    kwargs = {"model": ns.model} if ns.model else {}
    llm = LLM(kv_cache_memory="256MiB", max_model_len=1024, **kwargs)
    config = llm.llm_engine.config
    agreement, mean = teacher_forced(llm, sequences, model)
    sim_agreement, sim_mean = teacher_forced(None, sequences, model)
    positions = sum(len(s) - p for p, s in sequences)
    print(f"{ns.model or 'the default model'}: quantization {config.model.quantization}, "
          f"{positions} positions of {len(sequences)} questions")  # fmt: skip
    print(f"engine:     top-1 agreement {agreement:.2%}, mean |delta logprob| {mean:.4f}")
    print(f"simulation: top-1 agreement {sim_agreement:.2%}, mean |delta logprob| {sim_mean:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main, engine=False))
