"""The engine as the serving layer reads it when the engine runs in its own process
(engine/core_client.py): what an LLMEngine in this process would answer, from this side of the
channel; and what both describe of themselves alike (EngineDescription)."""

from __future__ import annotations

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.engine.arg_utils import create_engine_config
from pagedllm.model_loader.loader import load_model_tokenizer


class EngineDescription:
    """What an engine is, read from its EngineConfig (`config`): LLMEngine's and EngineInfo's."""

    config: EngineConfig

    @property
    def model_name(self) -> str:
        return self.config.model.name

    @property
    def model_config(self):
        """The model's architecture (ModelArchConfig)."""
        return self.config.model.arch

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def engine_stats(self) -> dict[str, dict]:
        """The counters (get_stats()) by data-parallel rank: this engine's alone."""
        return {str(self.config.parallel.data_parallel_rank): self.get_stats()}


class EngineInfo(EngineDescription):
    """What the serving layer reads of the engine, on this side of the channel: the resolved
    config and the tokenizer (the same the engine process resolves and loads), the engine's
    latest counters, and calls that go to the engine process."""

    def __init__(self, client, args: EngineArgs) -> None:
        """The config resolved here at once, so a bad flag or model fails before an engine
        starts; with --device auto as if on the CPU until the engine says its device
        (resolve_device): finding out would import torch, which this process never needs."""
        self._client = client
        self.args = args
        device = "cpu" if args.device == "auto" else None
        self.config = create_engine_config(args, device)
        self.tokenizer = load_model_tokenizer(args.model, args.tokenizer)

    def resolve_device(self, device: str) -> None:
        """The engine's own device (its Ready message): the config as the engine resolved it."""
        if device != self.config.device.device:
            self.config = create_engine_config(self.args, device)

    def get_stats(self) -> dict:
        return self._client.get_stats()

    def engine_stats(self) -> dict[str, dict]:
        """The counters by data-parallel rank (several with --data-parallel-size)."""
        return self._client.engine_stats()

    def lora_stats(self) -> dict | None:
        return self._client.lora_stats

    def check_lora(self, lora_request) -> None:
        """ValueError unless the engine can run the adapter (blocks: call it off the loop)."""
        self._client.call_blocking("check_lora", lora_request)
