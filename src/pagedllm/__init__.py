"""pagedllm: an LLM inference and serving engine built on PagedAttention."""

from pagedllm.logger import init_logger
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    Logprob,
    RequestOutput,
)
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.version import __version__  # noqa: F401 - pagedllm.__version__

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
    "LoRARequest",
]


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
