"""EngineClient: what the serving layer (entrypoints/openai) asks of an engine, wherever it runs.
Three implement it: AsyncLLMEngine (the engine loop on a thread of the server's process),
EngineCoreClient (the engine in its own process, restarted when it fails) and
DataParallelClient (several of those behind one server). The serving layer is typed against
this protocol; tests/engine/test_engine_client.py checks each implementation against it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from pagedllm.engine.engine_info import EngineDescription
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.request import EngineCoreRequest, PromptType
from pagedllm.sampling_params import SamplingParams


class EngineClient(Protocol):
    # What the serving layer reads of the engine: its config, tokenizer and counters, and the
    # adapter check (an LLMEngine in this process, or an EngineInfo on this side of a channel).
    engine: EngineDescription

    @property
    def has_loop_thread(self) -> bool:
        """False when the server's thread must call run_loop() (an in-process engine started
        without its thread)."""

    @property
    def is_running(self) -> bool: ...

    @property
    def is_restarting(self) -> bool:
        """An engine process is being replaced: requests wait for it (503 on /health)."""

    def check_health(self) -> None:
        """EngineDeadError when the engine cannot take requests."""

    def generate(
        self,
        prompt: PromptType | EngineCoreRequest,
        params: SamplingParams | PoolingParams,
        request_id: str,
        delta: bool = False,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput | PoolingRequestOutput]:
        """The request's outputs until it finishes; bad input raises ValueError on the first
        iteration; leaving early aborts it. `prompt`: a prompt, or the request the serving
        layer made already (an EngineCoreRequest of this id and params, taken whole)."""

    def abort(self, request_id: str) -> None: ...

    async def kv_snapshot(self, check: bool = False) -> dict: ...

    def shutdown(self, timeout: float | None = 10.0) -> None: ...
