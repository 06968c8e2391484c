"""SamplingParams validation: every bad value raises ValueError naming the field."""

import pytest

from pagedllm.sampling_params import SamplingParams

NAN = float("nan")


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("n", dict(n=0)),
        ("n", dict(n=1.5)),
        ("best_of", dict(n=3, best_of=2)),
        ("best_of", dict(best_of=2.0)),
        ("early_stopping", dict(use_beam_search=True, temperature=0, early_stopping="sometimes")),
        # length ** 1e308 overflows inside the engine loop, which stopped it for everyone
        ("length_penalty", dict(use_beam_search=True, temperature=0, length_penalty=1e308)),
        ("length_penalty", dict(use_beam_search=True, temperature=0, length_penalty=-11.0)),
        ("length_penalty", dict(use_beam_search=True, temperature=0, length_penalty=NAN)),
        ("presence_penalty", dict(presence_penalty=2.5)),
        ("presence_penalty", dict(presence_penalty=NAN)),
        ("frequency_penalty", dict(frequency_penalty=-2.1)),
        ("repetition_penalty", dict(repetition_penalty=0.0)),
        ("repetition_penalty", dict(repetition_penalty=2.5)),
        ("temperature", dict(temperature=-0.1)),
        ("temperature", dict(temperature=NAN)),
        ("top_p", dict(top_p=0.0)),
        ("top_p", dict(top_p=1.01)),
        ("top_k", dict(top_k=-2)),
        ("top_k", dict(top_k=2.5)),
        ("min_p", dict(min_p=-0.1)),
        ("min_p", dict(min_p=1.5)),
        ("seed", dict(seed="7")),
        ("seed", dict(seed=2**64)),
        ("seed", dict(seed=-(2**63) - 1)),
        ("max_tokens", dict(max_tokens=0)),
        ("max_tokens", dict(max_tokens=3.0)),
        ("min_tokens", dict(min_tokens=-1)),
        ("min_tokens", dict(min_tokens=5, max_tokens=4)),
        ("logprobs", dict(logprobs=-1)),
        ("logprobs", dict(logprobs=21)),
        ("prompt_logprobs", dict(prompt_logprobs=100)),
        ("stop", dict(stop="")),
        ("stop", dict(stop=["ok", ""])),
        ("stop", dict(stop=["ok", 3])),
        ("stop", dict(stop=5)),
        ("stop_token_ids", dict(stop_token_ids=[1, -1])),
        ("stop_token_ids", dict(stop_token_ids=["1"])),
        ("logit_bias", dict(logit_bias={1: 101.0})),
        ("logit_bias", dict(logit_bias={1: -100.5})),
        ("logit_bias", dict(logit_bias={-1: 1.0})),
        ("logit_bias", dict(logit_bias={"a": 1.0})),
        ("logit_bias", dict(logit_bias={1: "x"})),
    ],
)
def test_invalid_field_raises_naming_it(field, kwargs):
    with pytest.raises(ValueError, match=rf"^{field}\b"):  # the message starts with the field
        SamplingParams(**kwargs)


def test_defaults_and_normalization():
    p = SamplingParams(stop="###", top_k=-1, logit_bias={"5": 2})
    assert p.stop == ["###"] and p.top_k == 0 and p.logit_bias == {5: 2.0}
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []
    assert SamplingParams(temperature=0.0).is_greedy and not SamplingParams().is_greedy


def test_valid_edges_accepted():
    SamplingParams(
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=2.0,
        temperature=0.0,
        top_p=1.0,
        top_k=1,
        min_p=1.0,
        seed=0,
        max_tokens=None,
        min_tokens=10,
        logprobs=20,
        prompt_logprobs=0,
        logit_bias={0: -100, 7: 100},
    )
