"""The server's LoRA adapters, as vLLM serves them: each adapter is a model name (`--lora-modules
name=path`, listed by /v1/models with the base model as its `parent`), and with
`--allow-runtime-lora-updating` `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` add and
remove names while the server runs (behind --api-key like every route).

An adapter's id is the server's own counter, so a name loaded again from another path is another
adapter to the engine (its own slot contents and prefix-cache entries). Unloading removes the name
at once (new requests for it get a 404) while requests already running keep their adapter to the
end: the engine holds it by id, never by name."""

from __future__ import annotations

import asyncio
import itertools
import time

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import ModelCard
from pagedllm.lora_request import LoRARequest


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def parse_lora_modules(specs: list[str] | None) -> list[tuple[str, str]]:
    """`name=path` pairs (vLLM's --lora-modules), or its JSON form {"name": ..., "path": ...}."""
    import json

    modules = []
    for spec in specs or []:
        if spec.lstrip().startswith("{"):
            d = json.loads(spec)
            name, path = d.get("name"), d.get("path")
        else:
            name, _, path = spec.partition("=")
        if not name or not path:
            raise ValueError(f"--lora-modules takes name=path, got {spec!r}")
        modules.append((name, path))
    return modules


class LoRARegistry:
    """Adapter name -> LoRARequest, for the serving layer; checks adapters through the engine."""

    def __init__(self, async_engine: EngineClient, base_name: str) -> None:
        self.async_engine = async_engine
        self.base_name = base_name
        self.adapters: dict[str, LoRARequest] = {}
        self.created: dict[str, int] = {}
        self._ids = itertools.count(1)

    @property
    def enabled(self) -> bool:
        return self.async_engine.engine.config.lora is not None

    def add(self, name: str, path: str) -> LoRARequest:
        """Check the adapter (ValueError with the reason) and serve it as `name`."""
        if not self.enabled:
            raise ValueError("LoRA adapters need a server started with --enable-lora")
        if name == self.base_name or name in self.adapters:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        request = LoRARequest(name, next(self._ids), path)
        self.async_engine.engine.check_lora(request)
        self.adapters[name] = request
        self.created[name] = int(time.time())
        return request

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names, None for the base model; a 404 for anything else."""
        if model is None or model == self.base_name:
            return None
        request = self.adapters.get(model)
        if request is None:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")
        return request

    def cards(self, root_max_len: int) -> list[ModelCard]:
        return [
            ModelCard(
                id=name,
                root=r.lora_path,
                parent=self.base_name,
                created=self.created[name],
                max_model_len=root_max_len,
            )  # fmt: skip
            for name, r in self.adapters.items()
        ]


def add_lora_routes(app: FastAPI, registry: LoRARegistry) -> None:
    """vLLM's runtime load / unload routes (only with --allow-runtime-lora-updating)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        try:  # reading the adapter's file: off the event loop
            await asyncio.to_thread(registry.add, body.lora_name, body.lora_path)
        except ValueError as e:
            raise OpenAIError(str(e), 400, "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        request = registry.adapters.get(body.lora_name)
        if request is None or body.lora_int_id not in (None, request.lora_int_id):
            raise OpenAIError(
                f"The lora adapter '{body.lora_name}' cannot be found.", 404, "lora_name"
            )
        del registry.adapters[body.lora_name]
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
