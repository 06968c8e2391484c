"""A step that accepts several tokens at once (verified drafts) ends at a stop string as
decoding them one by one would: the tokens after the one that completes it are dropped, with
their logprobs, and the sequence stops with the string as its reason."""

from __future__ import annotations

import pytest

from pagedllm.engine.core_output import EngineCoreOutput, SampleDelta
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.model_loader.loader import load_model_tokenizer
from pagedllm.outputs import TokenLogprobs
from pagedllm.request import EngineCoreRequest
from pagedllm.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the default model's tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_tokenizer(None)


def accept_at_once(tokenizer, params: SamplingParams, text: str, finish_reason=None):
    """A request whose step accepted all of `text`'s tokens at once (each with logprob -1),
    through the output processor; returns (the processor's finish calls, the output)."""
    finished = []
    processor = OutputProcessor(tokenizer, lambda *call: finished.append(call))
    core = EngineCoreRequest.of(tokenizer, "r", "Count:", params, 0.0)
    processor.add_request(core, delta=False)
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    delta = SampleDelta(
        0, token_ids, [-1.0 * (i + 1) for i in range(len(token_ids))],
        [TokenLogprobs(t, -1.0, 1, []) for t in token_ids], finish_reason,
    )  # fmt: skip
    engine_done = finish_reason is not None  # the engine ended it on its last token
    (output,) = processor.process([EngineCoreOutput("r", [delta], engine_done)])
    assert output.finished == (engine_done or output.outputs[0].finish_reason is not None)
    return finished, output.outputs[0]


@pytest.mark.parametrize("engine_reason", [None, "length"])
def test_tokens_after_a_stop_string_are_dropped(tokenizer, engine_reason):
    params = SamplingParams(stop=[" three"], max_tokens=64, logprobs=0)
    text = " one two three four five six"
    finished, out = accept_at_once(tokenizer, params, text, engine_reason)
    kept = tokenizer.encode(" one two three", add_special_tokens=False)
    assert out.token_ids == kept and out.cumulative_logprob == -len(kept)
    assert (out.text, out.finish_reason, out.stop_reason) == (" one two", "stop", " three")
    assert len(out.logprobs) == len(kept)
    # The engine is told to drop the request, unless it ended it itself.
    assert finished == ([] if engine_reason else [("r", None)])


def test_a_stop_string_in_the_last_token_keeps_every_token(tokenizer):
    params = SamplingParams(stop=[" six"], max_tokens=64, include_stop_str_in_output=True)
    finished, out = accept_at_once(tokenizer, params, " one two three four five six")
    assert out.text == " one two three four five six" and out.stop_reason == " six"
    assert out.token_ids == tokenizer.encode(out.text, add_special_tokens=False)
    assert finished == [("r", None)]


def test_no_stop_string_keeps_the_text_whole(tokenizer):
    params = SamplingParams(stop=["seven"], max_tokens=64)
    finished, out = accept_at_once(tokenizer, params, " one two three four")
    assert out.text == " one two three four" and out.finish_reason is None
    assert finished == []
