"""The checks a request's prompt and pooling parameters must pass, written once, in the
wording of vLLM's server that clients match on ("maximum context length is N tokens"). The
serving layer runs them before a request reaches
the engine (its 400 names `param`, the request's field); the input processor runs them on every
request (the offline API's too), so that no engine takes a request it could not finish."""

from __future__ import annotations


class BadRequest(ValueError):
    """A request to refuse; `param`: the request's field at fault."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


def check_vocab(token_ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(
            f"token id {bad[0]} is out of range for a vocabulary of {vocab_size}", param
        )


def check_fits(
    num_tokens: int,
    max_model_len: int,
    generating: bool = True,
    param: str = "prompt",
    hint: str = "",
) -> None:
    """Not empty, and within max_model_len: with room for at least one generated token
    (`generating`), or whole (a pooling request's input). `hint`: another way out, after
    "Please reduce the length of the input"."""
    if num_tokens == 0:
        raise BadRequest(f"the {'prompt' if generating else 'input'} is empty: give at least "
                          "one token", param)  # fmt: skip
    if num_tokens >= max_model_len + (not generating):
        room = " (it needs room for at least one generated token)" if generating else ""
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens (max_model_len). "
            f"However, your request has {num_tokens} input tokens{room}. Please reduce the "
            f"length of the input{hint}.",
            param,
        )


def check_dimensions(dimensions: int | None, hidden_size: int, param: str = "dimensions") -> None:
    """An embedding's `dimensions` (the first this many kept) within the model's hidden size."""
    if dimensions is not None and dimensions > hidden_size:
        raise BadRequest(
            f"dimensions must be at most the model's hidden size {hidden_size}, got {dimensions}",
            param,
        )
