"""The bodies of POST /v1/embeddings (OpenAI's, with vLLM's extra fields) and of vLLM's
POST /pooling."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import OpenAIModel, OpenAIRequest


class EmbeddingRequest(OpenAIRequest):
    model: str | None = None
    # A string, strings, token ids, or lists of token ids (OpenAI's four forms)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # keep the first this many, before normalizing
    user: str | None = None
    # vLLM's extras
    normalize: bool = True  # scale each embedding to unit length (as OpenAI's are)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # keep the last N; -1: max
    add_special_tokens: bool = True  # e.g. BERT's [CLS] ... [SEP]
    priority: int = 0


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: the same input, each result as `data`."""


class EmbeddingData(OpenAIModel):
    index: int
    object: str = "embedding"
    embedding: list[float] | str  # a base64 string of little-endian float32 with "base64"


class PoolingData(OpenAIModel):
    index: int
    object: str = "pooling"
    data: list[float] | str


class EmbeddingUsage(OpenAIModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(OpenAIModel):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData] | list[PoolingData]
    usage: EmbeddingUsage
