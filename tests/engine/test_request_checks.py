"""The request checks the serving layer and the input processor share (engine/request_checks.py):
their boundaries, and the field each names."""

import pytest

from pagedllm.engine.request_checks import BadRequest, check_dimensions, check_fits, check_vocab


def test_a_prompt_needs_room_for_one_generated_token_an_input_only_fits():
    check_fits(63, 64)
    with pytest.raises(BadRequest, match=r"length is 64 tokens.*64 input tokens \(it needs"):
        check_fits(64, 64, param="messages")
    check_fits(64, 64, generating=False)  # a pooling input may fill the context
    with pytest.raises(BadRequest, match="65 input tokens. Please reduce") as e:
        check_fits(65, 64, generating=False, param="input")
    assert e.value.param == "input"
    with pytest.raises(BadRequest, match="the prompt is empty") as e:
        check_fits(0, 64)
    assert e.value.param == "prompt"
    with pytest.raises(BadRequest, match="the input is empty"):
        check_fits(0, 64, generating=False)


def test_token_ids_within_the_vocabulary_and_dimensions_within_the_hidden_size():
    check_vocab([0, 99], 100)
    for bad in (100, -1):
        with pytest.raises(BadRequest, match=f"token id {bad} is out of range") as e:
            check_vocab([5, bad, 7], 100, param="tokens")
        assert e.value.param == "tokens"
    check_dimensions(None, 64)
    check_dimensions(64, 64)
    with pytest.raises(BadRequest, match="at most the model's hidden size 64, got 65") as e:
        check_dimensions(65, 64)
    assert e.value.param == "dimensions" and isinstance(e.value, ValueError)
