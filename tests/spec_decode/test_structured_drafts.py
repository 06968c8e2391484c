"""Drafts under a grammar (structured outputs), with the default model: a draft is cut at its
first token the grammar refuses, each verified position is sampled under the grammar's state
after the drafts before it, and the output equals decoding without drafts."""

from __future__ import annotations

import re

import pytest

from pagedllm import LLM, SamplingParams, kernels
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.sequence import Sequence
from pagedllm.structured_output import StructuredOutputManager

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not kernels.available(), reason="needs the C++ kernels"),
]
ENGINE = dict(max_model_len=512, kv_cache_memory="128MiB")


@pytest.fixture(scope="module")
def llms():
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    return LLM(**ENGINE), LLM(speculative_config=spec, **ENGINE)


def test_drafts_are_cut_where_the_grammar_refuses(llms):
    tokenizer = llms[0].get_tokenizer()
    manager = StructuredOutputManager(tokenizer, llms[0].llm_engine.model_config.vocab_size,
                                      llms[0].llm_engine.eos_token_ids)  # fmt: skip
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(ab)+c"))
    seq = Sequence.of("r", tokenizer.encode("x"), params)
    seq.grammar = manager.grammar(params.structured_outputs)
    a, b, c = (tokenizer.encode(t, add_special_tokens=False)[0] for t in "abc")
    assert seq.usable_drafts([a, b, a, b, c, a], 512) == [a, b, a, b, c]
    assert seq.usable_drafts([b, a], 512) == []
    assert not seq.grammar.matcher.is_error()  # checking consumed nothing
    seq.append_output_token(a)
    assert seq.usable_drafts([b, c], 512) == [b, c]


def test_constrained_output_equals_it_without_drafts(llms):
    base, spec = llms
    constraint = {"regex": "(ha ){6}ha!"}
    prompt = "Laugh: ha ha ha ha ha ha ha ha ha ha ha!\nAgain:"
    params = SamplingParams(
        temperature=0, max_tokens=30,
        structured_outputs=StructuredOutputsParams(**constraint),
    )  # fmt: skip
    before = spec.llm_engine.scheduler.spec_decode_stats.num_accepted_tokens
    (want,) = base.generate([prompt], params, use_tqdm=False)
    (got,) = spec.generate([prompt], params, use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.outputs[0].text == want.outputs[0].text
    assert re.fullmatch(constraint["regex"], got.outputs[0].text)
    assert spec.llm_engine.scheduler.spec_decode_stats.num_accepted_tokens > before
