"""PoolingParams: what an embedding request asks for (vLLM's names). A request carrying them
is prefill-only: its prompt's hidden states are pooled into one vector, nothing is sampled,
and its KV blocks are freed as soon as the prompt is computed."""

from __future__ import annotations

from dataclasses import dataclass

# How the prompt's final hidden states become one vector: the last token's (decoder models
# trained for it, e.g. Qwen3-Embedding), their mean (sentence-transformers' usual), the first
# token's (BERT's [CLS]).
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass
class PoolingParams:
    """`normalize`: scale to unit L2 norm (after `dimensions`); `dimensions`: keep the first
    this many (Matryoshka-style truncation, as OpenAI's `dimensions`). `pooling_type` is the
    engine's (--pooling-type, or the model's own pooling config), filled in when queued."""

    normalize: bool = True
    dimensions: int | None = None
    pooling_type: str | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
            or self.dimensions < 1
        ):  # fmt: skip
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")
        if self.pooling_type is not None:
            self.pooling_type = self.pooling_type.upper()
            if self.pooling_type not in POOLING_TYPES:
                raise ValueError(
                    f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                    f"got {self.pooling_type!r}"
                )
