"""`LLM.beam_search` (vLLM's API) and beam search through `generate`, against HF transformers'
`generate(num_beams=...)`: token for token and score for score, on tiny random models (fast) and
on the real default model (slow)."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm import (
    LLM,
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    Logprob,
    SamplingParams,
)
from tests.conftest import hf_chat_ids, save_tiny_llama
from tests.model_loader.tiny_gguf import gpt2_vocab, random_hf_weights, write_tiny_llama


def hf_beam_search(
    model, prompt, *, beam_width, max_tokens, length_penalty, early_stopping, eos, pad
) -> tuple[list[list[int]], list[float]]:
    """HF's `beam_width` best outputs (its padding after an end token cut off) and their
    scores (`sequences_scores`: cumulative logprob / generated length ** length_penalty)."""
    x = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            x, attention_mask=torch.ones_like(x), num_beams=beam_width, do_sample=False,
            num_return_sequences=beam_width, max_new_tokens=max_tokens,
            length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos,
            pad_token_id=pad, return_dict_in_generate=True, output_scores=True,
        )  # fmt: skip
    outputs = []
    for row in out.sequences.tolist():
        generated = row[len(prompt) :]
        end = next((i for i, t in enumerate(generated) if t in eos), None)
        outputs.append(generated if end is None else generated[: end + 1])
    return outputs, out.sequences_scores.tolist()


def our_scores(result: BeamSearchOutput, prompt_len: int, length_penalty: float) -> list[float]:
    return [
        s.cum_logprob / (len(s.tokens) - prompt_len) ** length_penalty for s in result.sequences
    ]


def assert_matches_hf(results, prompts, expected, length_penalty):
    for result, prompt, (hf_outputs, hf_scores) in zip(results, prompts, expected, strict=True):
        ours = [s.tokens[len(prompt) :] for s in result.sequences]
        assert [s.tokens[: len(prompt)] for s in result.sequences] == [prompt] * len(ours)
        assert ours == hf_outputs, f"prompt {prompt}:\n ours {ours}\n HF   {hf_outputs}"
        scores = our_scores(result, len(prompt), length_penalty)
        assert scores == pytest.approx(hf_scores, rel=1e-4, abs=1e-5)


# -- the API's shape, on a tiny GGUF with a tokenizer ----------------------------------------------
@pytest.fixture(scope="module")
def tiny_gguf_llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gguf-beam") / "tiny.gguf"
    write_tiny_llama(path, random_hf_weights(len(gpt2_vocab()[0])))
    return LLM(dtype="float32", model=str(path), kv_cache_memory="8MiB", block_size=4)


def test_beam_search_api_shape(tiny_gguf_llm):
    llm = tiny_gguf_llm
    tokenizer = llm.get_tokenizer()
    prompts = ["hello world", [5, 6, 7, 8, 9], {"prompt": "the"}, {"prompt_token_ids": [40, 41]}]
    width, max_tokens = 3, 7
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens)
    results = llm.beam_search(prompts, params)
    assert len(results) == len(prompts)
    prompt_ids = [
        tokenizer.encode("hello world"), [5, 6, 7, 8, 9], tokenizer.encode("the"), [40, 41]
    ]  # fmt: skip
    for result, prompt in zip(results, prompt_ids, strict=True):
        assert isinstance(result, BeamSearchOutput)
        assert len(result.sequences) == width
        assert len({tuple(s.tokens) for s in result.sequences}) == width  # distinct beams
        for seq in result.sequences:
            assert isinstance(seq, BeamSearchSequence)
            assert seq.tokens[: len(prompt)] == prompt  # tokens = prompt + output
            output = seq.tokens[len(prompt) :]
            assert len(output) == max_tokens and seq.finish_reason == "length"
            assert seq.stop_reason is None
            assert seq.text == tokenizer.decode(output, skip_special_tokens=True)
            # Per output token: the chosen token's logprob among the beam's top candidates.
            assert len(seq.logprobs) == len(output)
            for token_id, entry in zip(output, seq.logprobs, strict=True):
                assert token_id in entry and isinstance(entry[token_id], Logprob)
                assert min(lp.rank for lp in entry.values()) == 1
            chosen = sum(entry[t].logprob for t, entry in zip(output, seq.logprobs, strict=True))
            assert chosen == pytest.approx(seq.cum_logprob, abs=1e-4)
        scores = our_scores(result, len(prompt), 1.0)
        assert scores == sorted(scores, reverse=True)  # best first
    # The same search through `generate` with the equivalent SamplingParams.
    via_generate = llm.generate(prompts, params.to_sampling_params(), use_tqdm=False)
    for result, output in zip(results, via_generate, strict=True):
        assert [s.tokens for s in result.sequences] == [
            output.prompt_token_ids + c.token_ids for c in output.outputs
        ]
        assert [s.text for s in result.sequences] == [c.text for c in output.outputs]
    llm.llm_engine.scheduler.check_integrity()
    assert llm.llm_engine.scheduler.kv_cache_manager.num_free_blocks == llm.llm_engine.num_blocks


def test_beam_search_single_prompt_and_stop_token(tiny_gguf_llm):
    llm = tiny_gguf_llm
    tokenizer = llm.get_tokenizer()
    (free,) = llm.beam_search([7, 8, 9], BeamSearchParams(beam_width=2, max_tokens=6))
    # Make the best first token a stop token: some beam must end on it, its text without it.
    stop = free.sequences[0].tokens[3]
    params = BeamSearchParams(beam_width=2, max_tokens=6, stop_token_ids=[stop])
    (result,) = llm.beam_search({"prompt_token_ids": [7, 8, 9]}, params)
    stopped = [s for s in result.sequences if s.finish_reason == "stop"]
    assert stopped
    for seq in stopped:
        assert seq.tokens[-1] == stop and seq.stop_reason == stop
        assert seq.text == tokenizer.decode(seq.tokens[3:-1], skip_special_tokens=True)
    scores = our_scores(result, 3, 1.0)
    assert scores == sorted(scores, reverse=True)


def test_beam_search_params_rejected_clearly(tiny_gguf_llm):
    with pytest.raises(ValueError, match="beam_width"):
        tiny_gguf_llm.beam_search([1, 2], BeamSearchParams(beam_width=0, max_tokens=4))
    with pytest.raises(ValueError, match="temperature"):
        tiny_gguf_llm.beam_search(
            [1, 2], BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
        )


# -- token parity with HF on a tiny random Llama (fast) --------------------------------------------
TINY_PROMPTS = [[5, 9, 3], [17, 4, 88, 23, 6, 70, 11, 42, 9, 1, 66], [100]]


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-beam")
    model = save_tiny_llama(path)
    llm = LLM(dtype="float32", model=str(path), kv_cache_memory="8MiB", block_size=4)
    return model, llm


@pytest.mark.parametrize(
    "beam_width,length_penalty,early_stopping",
    [(2, 1.0, False), (3, 0.5, True), (4, 2.0, False), (3, 1.0, "never")],
)
def test_tiny_model_matches_hf(tiny_hf, beam_width, length_penalty, early_stopping):
    model, llm = tiny_hf
    max_tokens = 12
    # A random model rarely picks its EOS (2), so a second end token is taken from HF's own
    # beams: the second token of the best beam on the first prompt, so some beams end early.
    probe, _ = hf_beam_search(
        model, TINY_PROMPTS[0], beam_width=beam_width, max_tokens=max_tokens,
        length_penalty=length_penalty, early_stopping=early_stopping, eos=[2], pad=0,
    )  # fmt: skip
    stop = probe[0][1]
    eos = [stop, 2]
    expected = [
        hf_beam_search(
            model,
            p,
            beam_width=beam_width,
            max_tokens=max_tokens,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            eos=eos,
            pad=0,
        )  # fmt: skip
        for p in TINY_PROMPTS
    ]
    if length_penalty <= 1.0:  # (a penalty of 2 favours long beams: they may all run out)
        assert any(len(out) < max_tokens for outs, _ in expected for out in outs)
    params = BeamSearchParams(
        beam_width=beam_width, max_tokens=max_tokens, length_penalty=length_penalty,
        early_stopping=early_stopping, stop_token_ids=[stop],
    )  # fmt: skip
    results = llm.beam_search([{"prompt_token_ids": p} for p in TINY_PROMPTS], params)
    assert_matches_hf(results, TINY_PROMPTS, expected, length_penalty)
    llm.llm_engine.scheduler.check_integrity()


def test_generate_with_beam_search_params_returns_the_best_n(tiny_hf):
    """vLLM V0's extra parameters: `use_beam_search`, `best_of` beams, the `n` best returned."""
    model, llm = tiny_hf
    prompt = TINY_PROMPTS[1]
    hf_outputs, hf_scores = hf_beam_search(
        model, prompt, beam_width=4, max_tokens=10, length_penalty=0.7, early_stopping=False,
        eos=[2], pad=0,
    )  # fmt: skip
    params = SamplingParams(
        n=2, best_of=4, use_beam_search=True, temperature=0, length_penalty=0.7, max_tokens=10
    )
    (output,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert output.finished
    assert [c.token_ids for c in output.outputs] == hf_outputs[:2]
    assert [c.index for c in output.outputs] == [0, 1]
    scores = [c.cumulative_logprob / len(c.token_ids) ** 0.7 for c in output.outputs]
    assert scores == pytest.approx(hf_scores[:2], rel=1e-4, abs=1e-5)


# -- the real default model (slow) ----------------------------------------------------------------
MAX_TOKENS = 20
CHAT_QUESTIONS = ["What is the capital of France?", "List three prime numbers."]
TEXT_PROMPT = "The three primary colors are"
# (beam width, length penalty, early stopping): every pair of values of two of the three, over
# widths 2 and 4, length penalties 1.0 and 2.0, early stopping off, on and HF's "never" (the
# tiny model above runs other combinations; each case here costs 10-40 s of HF beam search).
DEFAULT_MODEL_CASES = [
    (2, 1.0, False), (2, 2.0, True), (4, 1.0, True), (4, 2.0, False), (4, 2.0, "never"),
]  # fmt: skip


@pytest.fixture(scope="module")
def default_llm():
    return LLM(dtype="float32", kv_cache_memory="256MiB", max_model_len=1024)


@pytest.fixture(scope="module")
def default_prompts(hf_default_model):
    """Two chat prompts (their replies can end on EOS within MAX_TOKENS) and a plain text one
    (given to pagedllm as a string, to check that it tokenizes like HF)."""
    _, tokenizer = hf_default_model
    ids = [hf_chat_ids(tokenizer, question) for question in CHAT_QUESTIONS]
    ids.append(tokenizer(TEXT_PROMPT)["input_ids"])
    ours = [{"prompt_token_ids": p} for p in ids[:-1]] + [TEXT_PROMPT]
    return ours, ids


@pytest.mark.slow
@pytest.mark.parametrize("beam_width,length_penalty,early_stopping", DEFAULT_MODEL_CASES)
def test_default_model_matches_hf(
    default_llm, default_prompts, hf_default_model, beam_width, length_penalty, early_stopping
):
    model, tokenizer = hf_default_model
    ours_prompts, prompt_ids = default_prompts
    eos = list(default_llm.llm_engine.eos_token_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    expected = [
        hf_beam_search(
            model,
            p,
            beam_width=beam_width,
            max_tokens=MAX_TOKENS,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            eos=eos,
            pad=pad,
        )  # fmt: skip
        for p in prompt_ids
    ]
    params = BeamSearchParams(
        beam_width=beam_width, max_tokens=MAX_TOKENS, length_penalty=length_penalty,
        early_stopping=early_stopping,
    )  # fmt: skip
    results = default_llm.beam_search(ours_prompts, params)
    assert_matches_hf(results, prompt_ids, expected, length_penalty)
    # The chat prompts reach EOS: those beams say "stop" and their text leaves the EOS out.
    ended = [s for r in results[:-1] for s in r.sequences if s.tokens[-1] in eos]
    assert ended
    for result, prompt in zip(results, prompt_ids, strict=True):
        for seq in result.sequences:
            output = seq.tokens[len(prompt) :]
            if output[-1] in eos:
                assert seq.finish_reason == "stop"
                output = output[:-1]
            else:
                assert seq.finish_reason == "length" and len(output) == MAX_TOKENS
            assert seq.text == tokenizer.decode(output, skip_special_tokens=True)
            assert math.isfinite(seq.cum_logprob) and seq.cum_logprob < 0
    default_llm.llm_engine.scheduler.check_integrity()
    kv = default_llm.llm_engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == default_llm.llm_engine.num_blocks
