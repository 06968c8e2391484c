"""SamplingParams with vLLM's field names; bad values raise ValueError naming the field."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_SAMPLING_EPS = 1e-5
_MAX_LENGTH_PENALTY = 10.0
MAX_LOGPROBS = 20  # logprobs / prompt_logprobs per token, at most (as vLLM's default)


@dataclass
class StructuredOutputsParams:
    """Constrain the output (vLLM's names): exactly one of a JSON schema (a dict or its JSON
    text), a regular expression, a list of choices, a grammar (Lark or llama.cpp's GBNF), or
    json_object=True for any JSON object. disable_any_whitespace: compact JSON only."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        kinds = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar or "
                f"json_object, got {kinds or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except (json.JSONDecodeError, RecursionError) as e:
                raise ValueError(f"structured_outputs json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured_outputs json must be a JSON schema object")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs {name} must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                "structured_outputs choice must be a non-empty list of non-empty strings"
            )
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs json_object must be a boolean")

    @property
    def kind(self) -> str:
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class SamplingParams:
    n: int = 1
    # Samples to generate, of which the n with the highest cumulative logprob are returned
    # (vLLM dropped it; OpenAI clients still send it). None: n. With beam search, the beam width.
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs to return per generated token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    # Beam search (as vLLM's V0 extra parameters): best_of (or n) beams, the n best returned,
    # ranked by cumulative logprob / generated_length ** length_penalty. early_stopping: True stops
    # once best_of hypotheses are finished, False when no running beam can still beat them (HF's
    # heuristic), "never" only at max_tokens or when that is provably true.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # Constrained decoding (JSON schema, regex, choice, grammar); see StructuredOutputsParams.
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine, not by users.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def _verify(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.best_of is not None:
            if not isinstance(self.best_of, int) or self.best_of < self.n:
                raise ValueError(
                    f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}"
                )
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "must be a StructuredOutputsParams")
            if self.use_beam_search:
                raise ValueError("structured_outputs are not supported with beam search")
        if self.use_beam_search:
            self._verify_beam_search()
        elif self.length_penalty != 1.0 or self.early_stopping is not False:
            raise ValueError("length_penalty and early_stopping only apply with use_beam_search")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "must be in (0, 2]")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise bad("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63
        ):  # torch generators take 64 bits; sample i draws with seed + i
            raise bad("seed", "must be a 64-bit signed integer")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens}, "
                f"max_tokens={self.max_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}]")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.logit_bias is not None:
            logit_bias = {}
            for token_id, bias in self.logit_bias.items():
                try:  # keys may be strings, as in OpenAI requests
                    token_id, bias = int(token_id), float(bias)
                except (TypeError, ValueError):
                    raise bad("logit_bias", "must map token ids to numbers") from None
                if token_id < 0:
                    raise ValueError(f"logit_bias token ids must be non-negative, got {token_id}")
                if not -100.0 <= bias <= 100.0:
                    raise ValueError(
                        f"logit_bias for token {token_id} must be in [-100, 100], got {bias}"
                    )
                logit_bias[token_id] = bias
            self.logit_bias = logit_bias

    def _verify_beam_search(self) -> None:
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f'early_stopping must be true, false or "never", got {self.early_stopping!r}'
            )
        # Beams rank by logprob / length ** length_penalty: a huge exponent overflows the float
        # (or underflows it to 0) inside the engine loop, which would stop it for every request.
        if not isinstance(self.length_penalty, int | float) or not (
            -_MAX_LENGTH_PENALTY <= self.length_penalty <= _MAX_LENGTH_PENALTY
        ):
            raise ValueError(
                f"length_penalty must be a number in [-{_MAX_LENGTH_PENALTY:g}, "
                f"{_MAX_LENGTH_PENALTY:g}], got {self.length_penalty!r}"
            )
        if self.stop:
            raise ValueError("stop strings are not supported with beam search (use stop_token_ids)")
        if not self.is_greedy or self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0:
            raise ValueError(
                "beam search is deterministic: temperature must be 0 and top_p, top_k and min_p "
                "must be left at their defaults"
            )

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs: best_of (or n) samples, or that many beams."""
        return self.best_of or self.n

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)


@dataclass
class BeamSearchParams:
    """`LLM.beam_search` parameters (vLLM's names). Deterministic: temperature must be 0."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False
    stop_token_ids: list[int] | None = None

    def to_sampling_params(self, n: int | None = None) -> SamplingParams:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        return SamplingParams(
            n=n or self.beam_width,
            best_of=self.beam_width,
            use_beam_search=True,
            temperature=self.temperature,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            include_stop_str_in_output=self.include_stop_str_in_output,
            stop_token_ids=self.stop_token_ids,
        )
