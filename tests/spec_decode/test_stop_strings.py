"""A step that accepts several tokens at once (verified drafts) ends at a stop string as
decoding them one by one would: the tokens after the one that completes it are dropped, with
their logprobs, and the sequence stops with the string as its reason."""

from __future__ import annotations

import pytest

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.model_loader.loader import load_model_tokenizer
from pagedllm.outputs import ModelRunnerOutput, TokenLogprobs
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the default model's tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_tokenizer(None)


def finish_seq(seq: Request, status: RequestStatus) -> None:
    """What the scheduler does when a stop string ends a sequence."""
    seq.status = status
    seq.group.seqs.remove(seq)
    seq.group.finished_seqs.append(seq)


def accept_at_once(tokenizer, params: SamplingParams, text: str, status=None):
    """A request whose step accepted all of `text`'s tokens at once (each with logprob -1),
    through the output processor; returns (request, its output)."""
    seq = Request("r", tokenizer.encode("Count:"), params)
    processor = OutputProcessor(tokenizer, finish_seq, lambda ids: None)
    processor.add_request(seq.group, delta=False)
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        seq.append_output_token(token_id)
        seq.output_logprobs.append(TokenLogprobs(token_id, -1.0, 1, []))
        seq.cumulative_logprob -= 1.0
    if status is not None:
        finish_seq(seq, status)  # the scheduler ended it on its last token
    (output,) = processor.process(SchedulerOutput([], {}, {}, 0), ModelRunnerOutput({}),
                                  [seq.group])  # fmt: skip
    return seq, output.outputs[0]


@pytest.mark.parametrize("status", [None, RequestStatus.FINISHED_LENGTH_CAPPED])
def test_tokens_after_a_stop_string_are_dropped(tokenizer, status):
    params = SamplingParams(stop=[" three"], max_tokens=64, logprobs=0)
    seq, out = accept_at_once(tokenizer, params, " one two three four five six", status)
    kept = len(tokenizer.encode(" one two three", add_special_tokens=False))
    assert seq.output_token_ids == tokenizer.encode(" one two three", add_special_tokens=False)
    assert len(seq.output_logprobs) == kept and seq.cumulative_logprob == -kept
    assert (out.text, out.finish_reason, out.stop_reason) == (" one two", "stop", " three")
    assert len(out.token_ids) == len(out.logprobs) == kept
    assert seq.status == RequestStatus.FINISHED_STOPPED


def test_a_stop_string_in_the_last_token_keeps_every_token(tokenizer):
    params = SamplingParams(stop=[" six"], max_tokens=64, include_stop_str_in_output=True)
    seq, out = accept_at_once(tokenizer, params, " one two three four five six")
    assert out.text == " one two three four five six" and out.stop_reason == " six"
    assert seq.num_output_tokens == len(tokenizer.encode(out.text, add_special_tokens=False))


def test_no_stop_string_keeps_the_text_whole(tokenizer):
    params = SamplingParams(stop=["seven"], max_tokens=64)
    seq, out = accept_at_once(tokenizer, params, " one two three four")
    assert out.text == " one two three four" and out.finish_reason is None
    assert not seq.is_finished()
