"""pagedllm: an LLM inference and serving engine built on PagedAttention."""

from pagedllm.logger import init_logger
from pagedllm.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    Logprob,
    RequestOutput,
)
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

init_logger()

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineArgs",
    "SamplingParams",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Import the heavy parts (torch, the model code) only when they are asked for.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pagedllm.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "EngineArgs":
        from pagedllm.config import EngineArgs

        return EngineArgs
    raise AttributeError(name)
