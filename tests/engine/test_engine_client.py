"""The three engine clients against the one protocol the serving layer is typed for
(engine/protocol.py): each has every member, and each generate takes the protocol's whole
argument list (a client that dropped or renamed a parameter would fail here, not in a
server)."""

from __future__ import annotations

import inspect

import pytest

from pagedllm.engine.async_llm_engine import AsyncLLMEngine
from pagedllm.engine.core_client import EngineCoreClient
from pagedllm.engine.dp_client import DataParallelClient
from pagedllm.engine.protocol import EngineClient
from pagedllm.sampling_params import SamplingParams

CLIENTS = [AsyncLLMEngine, EngineCoreClient, DataParallelClient]
MEMBERS = [name for name in vars(EngineClient) if not name.startswith("_")]


def test_the_protocol_names_what_the_serving_layer_uses():
    assert {"generate", "abort", "kv_snapshot", "check_health", "shutdown", "is_running",
            "is_restarting", "has_loop_thread"} <= set(MEMBERS)  # fmt: skip


@pytest.mark.parametrize("client", CLIENTS, ids=lambda c: c.__name__)
def test_each_client_has_every_member_in_its_kind(client):
    for name in MEMBERS:
        want = inspect.getattr_static(EngineClient, name)
        got = inspect.getattr_static(client, name, None)
        assert got is not None, f"{client.__name__} has no {name}"
        assert isinstance(got, property) == isinstance(want, property), (client.__name__, name)
        if inspect.isfunction(want):
            assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), name
    assert inspect.isasyncgenfunction(client.generate)  # the serving layer's `async for`


@pytest.mark.parametrize("client", CLIENTS, ids=lambda c: c.__name__)
def test_each_client_takes_the_protocols_arguments(client):
    params = SamplingParams()
    calls = {
        "generate": (
            ("prompt", params, "id"),
            dict(delta=True, cache_salt="s", lora_request=None, priority=1),
        ),  # fmt: skip
        "abort": (("id",), {}),
        "kv_snapshot": ((), dict(check=True)),
        "shutdown": ((), dict(timeout=1.0)),
        "check_health": ((), {}),
    }
    for name, (args, kwargs) in calls.items():
        inspect.signature(getattr(client, name)).bind(None, *args, **kwargs)  # None: self
