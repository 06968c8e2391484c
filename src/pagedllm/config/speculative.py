"""--speculative-config: what speculative decoding proposes and how much (vLLM's JSON).

A JSON object (or a dict, from `LLM(speculative_config=...)`) with `method` and
`num_speculative_tokens`, and the method's own fields under vLLM's names:

- `ngram`: `prompt_lookup_min`, `prompt_lookup_max` (the n-gram sizes matched against the
  request's own tokens);
- `suffix`: `suffix_decoding_max_tree_depth`, `suffix_decoding_max_spec_factor`,
  `suffix_decoding_min_token_prob`, `suffix_decoding_max_cached_requests`;
- `draft_model`: `model` (a path or name, with the target's vocabulary; default: the target
  itself) and `quantization` (the draft's weights: default int4 when drafting with the target's
  own weights, else auto);

and for every method `disable_by_batch_size`: no drafts in a step of more requests than this
(default 32, measured: docs/speculative_decoding.md; null: at any batch size). Unknown methods
and fields, and values out of range, are errors that name the flag."""

from __future__ import annotations

from dataclasses import dataclass, fields

from pagedllm.config.json_flag import json_object

FLAG = "--speculative-config"
METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # drafts verified per request and step, at most
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_cached_requests: int = 10000
    model: str | None = None  # draft_model: the draft (None: the target's own weights)
    quantization: str | None = None  # draft_model: its weights (None: int4 for self-drafting)
    # Measured here (docs/speculative_decoding.md): at 32 running requests drafts still gain
    # 0.98-1.14x, at 64 they lose 4-11% (the step is compute-bound); None: at every batch size.
    disable_by_batch_size: int | None = 32

    @classmethod
    def parse(cls, value: str | dict | None) -> SpeculativeConfig | None:
        """The config from the flag's JSON text or a dict; None when not given."""
        value = json_object(value, FLAG, cls)
        if value is None:
            return None
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"{FLAG}: method must be one of {', '.join(METHODS)}, got {method!r}")
        values = dict(value)
        if method == "suffix":
            depth = values.get("suffix_decoding_max_tree_depth", 24)
            values.setdefault("num_speculative_tokens", depth)
        elif "num_speculative_tokens" not in values:
            raise ValueError(f"{FLAG}: method {method} needs num_speculative_tokens")
        if method == "ngram" and "prompt_lookup_min" in values:
            values.setdefault("prompt_lookup_max", max(values["prompt_lookup_min"], 4))
        if method == "ngram" and "prompt_lookup_max" in values:
            values.setdefault("prompt_lookup_min", min(values["prompt_lookup_max"], 2))
        config = cls(**values)
        config._check()
        return config

    def _check(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"{FLAG}: {what}")

        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("method", "model", "quantization") or value is None:
                continue
            number = isinstance(value, int | float) and not isinstance(value, bool)
            need(number and (f.type == "float" or isinstance(value, int)),
                 f"{f.name} must be {'a number' if f.type == 'float' else 'an integer'}, "
                 f"got {value!r}")  # fmt: skip
        need(
            self.num_speculative_tokens >= 1,
            f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}",
        )
        need(
            1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
            "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
            f"{self.prompt_lookup_min} and {self.prompt_lookup_max}",
        )
        need(
            self.suffix_decoding_max_tree_depth >= 1, "suffix_decoding_max_tree_depth must be >= 1"
        )
        need(
            self.suffix_decoding_max_spec_factor > 0, "suffix_decoding_max_spec_factor must be > 0"
        )
        need(
            0 <= self.suffix_decoding_min_token_prob <= 1,
            "suffix_decoding_min_token_prob must be in [0, 1]",
        )
        need(
            self.suffix_decoding_max_cached_requests >= 0,
            "suffix_decoding_max_cached_requests must be >= 0",
        )
        need(self.model is None or isinstance(self.model, str), "model must be a path or name")
        need(
            self.quantization in (None, "auto", "none", "int8", "int4"),
            f"quantization must be one of auto, none, int8, int4, got {self.quantization!r}",
        )
        if self.method != "draft_model":
            need(
                self.model is None and self.quantization is None,
                f"model and quantization are draft_model's fields, not {self.method}'s",
            )
        need(self.disable_by_batch_size is None or self.disable_by_batch_size >= 1,
             "disable_by_batch_size must be >= 1")  # fmt: skip

    @property
    def draft_quantization(self) -> str:
        """The draft's weights: as asked, else int4 codes of the target's own weights."""
        if self.quantization is not None:
            return self.quantization
        return "int4" if self.model is None else "auto"
