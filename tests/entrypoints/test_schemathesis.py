"""schemathesis against every route of the app's own OpenAPI schema: bodies, parameters and
headers generated from it (valid and not), sent to the real app over a real engine (a tiny
random Llama with the default model's tokenizer and chat template). Whatever comes in: never a
server error (5xx), and the engine still serves a normal request afterwards with its KV pool
clean. The hand-written fuzzing of completions and chat with hostile values (NaN, huge
numbers, lone surrogates, invalid UTF-8, deep nesting) is test_fuzz_api.py."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.server_config import ServerConfig
from tests.conftest import save_tiny_llama


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-49k-schemathesis")
    save_tiny_llama(path, vocab_size=49152, max_position_embeddings=512)
    args = EngineArgs(model=str(path), tokenizer="SmolLM2-135M-Instruct", dtype="float32",
                      max_model_len=64, kv_cache_memory="8MiB", max_num_seqs=8)  # fmt: skip
    engine = AsyncLLMEngine(LLMEngine(args))
    yield engine, build_app(engine, ServerConfig("m"))
    engine.shutdown()


def _operations(app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    return schema, [result.ok() for result in schema.get_all_operations()]


# Generation is capped by max_model_len (64): every generated request stays cheap.
CASES = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))  # fmt: skip


def _served_model(case, keep: bool):
    """Most bodies name the served model, so that they get past the model check."""
    if not keep and isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = "m"
    return case


def _fuzz(operation, statuses: dict[str, set[int]]) -> None:
    cases = st.one_of(
        operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
        operation.as_strategy(generation_mode=GenerationMode.NEGATIVE),
    )
    cases = st.tuples(cases, st.booleans()).map(lambda t: _served_model(*t))

    @CASES
    @given(case=cases)
    def check(case):
        response = case.call()
        statuses.setdefault(operation.label, set()).add(response.status_code)
        assert response.status_code < 500, (operation.label, case.body, response.text)

    check()


def test_no_route_answers_a_server_error(served):
    engine, app = served
    schema, operations = _operations(app)
    labels = {op.label for op in operations}
    # Every route is in the schema (a route left out would go unfuzzed)
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses",
            "POST /v1/messages", "POST /v1/embeddings", "POST /tokenize"} <= labels  # fmt: skip
    statuses: dict[str, set[int]] = {}
    for operation in operations:
        _fuzz(operation, statuses)
    print("\nschemathesis statuses by route:", {k: sorted(v) for k, v in statuses.items()})
    assert len(statuses) == len(operations)
    # Afterwards: idle, every block free, and a normal request still served
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        ok = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert ok.status_code == 200
    assert not engine.engine.has_unfinished_requests()
    assert engine.engine.get_stats()["kv_cache_usage"] == 0
