"""POST /v1/embeddings and /pooling through the real server with the openai client, on a tiny
random Llama run by the pooling runner (last-token pooling, float32): each embedding equals
HF transformers' last hidden state of its input, normalized (or cut to `dimensions` first),
as floats and as base64 (the openai SDK's default); the usage counts the inputs' tokens; bad
input gets OpenAI's error shape; a generation server refuses embeddings and a pooling server
refuses generation, each saying how to start the other."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from benchmarks.soak_targets import serve_in_thread
from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from tests.conftest import save_tiny_llama
from tests.waiting import wait_until

TEXTS = ["The capital of France is", "Paged attention keeps the KV cache in blocks.", "hi"]


def _serve(path, **engine_args):
    args = EngineArgs(model=str(path), tokenizer="SmolLM2-135M-Instruct", dtype="float32",
                      max_model_len=64, kv_cache_memory="16MiB", **engine_args)  # fmt: skip
    return AsyncLLMEngine(LLMEngine(args))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-49k-embed")
    model = save_tiny_llama(path, vocab_size=49152, max_position_embeddings=512)
    pooling, generating = _serve(path, runner="pooling"), _serve(path)
    try:
        with serve_in_thread(pooling, "m") as url, serve_in_thread(generating, "g") as gen_url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            yield client, url, gen_url, model, pooling.engine
    finally:
        pooling.shutdown()
        generating.shutdown()


def _last_hidden(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0, -1]


def test_embeddings_equal_hf_float_and_base64(served):
    client, _, _, model, engine = served
    tokenizer = engine.tokenizer
    as_floats = client.embeddings.create(model="m", input=TEXTS, encoding_format="float")
    as_base64 = client.embeddings.create(model="m", input=TEXTS)  # the SDK asks for base64
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == sum(map(len, ids))
    assert as_floats.model == "m" and [d.index for d in as_floats.data] == [0, 1, 2]
    for a, b, prompt in zip(as_floats.data, as_base64.data, ids, strict=True):
        expected = torch.nn.functional.normalize(_last_hidden(model, prompt), dim=-1)
        got = torch.tensor(a.embedding)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
        assert a.embedding == b.embedding  # base64 carries the same float32 values


def test_token_ids_dimensions_and_pooling_route(served):
    client, url, _, model, _ = served
    prompt = [(7 * i + 3) % 900 + 100 for i in range(20)]
    cut = client.embeddings.create(model="m", input=[prompt], dimensions=8, encoding_format="float")
    expected = torch.nn.functional.normalize(_last_hidden(model, prompt)[:8], dim=-1)
    torch.testing.assert_close(torch.tensor(cut.data[0].embedding), expected, atol=2e-5, rtol=1e-5)
    raw = httpx.post(f"{url}/pooling", json={"input": prompt, "normalize": False,
                                             "encoding_format": "base64"}).json()  # fmt: skip
    assert raw["object"] == "list" and raw["data"][0]["object"] == "pooling"
    data = np.frombuffer(base64.b64decode(raw["data"][0]["data"]), dtype="<f4")
    torch.testing.assert_close(torch.from_numpy(data.copy()), _last_hidden(model, prompt),
                               atol=2e-5, rtol=1e-5)  # fmt: skip
    assert raw["usage"]["prompt_tokens"] == 20


@pytest.mark.parametrize(
    "body, status, param, words",
    [
        ({"input": []}, 400, "input", "must not be empty"),
        ({"input": ""}, 400, "input", "empty"),
        ({"input": [[1] * 65]}, 400, "input", "maximum context length is 64"),
        ({"input": [[49152]]}, 400, "input", "out of range"),
        ({"input": "x", "dimensions": 65}, 400, "dimensions", "hidden size 64"),
        ({"input": "x", "dimensions": 0}, 400, "dimensions", ">= 1"),
        ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format", "float"),
        ({"input": "x", "model": "nope"}, 404, "model", "does not exist"),
    ],
)
def test_bad_input(served, body, status, param, words):
    _, url, _, _, _ = served
    response = httpx.post(f"{url}/v1/embeddings", json=body)
    error = response.json()["error"]
    assert response.status_code == status and error["param"] == param, error
    assert words in error["message"]


def test_truncate_prompt_tokens_keeps_the_last(served):
    client, _, _, model, _ = served
    prompt = [(5 * i + 1) % 900 + 100 for i in range(80)]  # longer than max_model_len (64)
    out = client.embeddings.create(model="m", input=[prompt], encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 30})  # fmt: skip
    expected = torch.nn.functional.normalize(_last_hidden(model, prompt[-30:]), dim=-1)
    torch.testing.assert_close(torch.tensor(out.data[0].embedding), expected, atol=2e-5,
                               rtol=1e-5)  # fmt: skip
    assert out.usage.prompt_tokens == 30


def test_each_runner_refuses_the_other_kind(served):
    client, _, gen_url, _, engine = served
    with pytest.raises(openai.BadRequestError, match="pooling runner"):
        client.completions.create(model="m", prompt="hello", max_tokens=2)
    generator = openai.OpenAI(base_url=f"{gen_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        generator.embeddings.create(model="g", input="hello")
    # Nothing left behind by this file's requests, refused or not
    assert not engine.has_unfinished_requests()
    assert engine.get_stats()["kv_cache_usage"] == 0


def test_disconnect_aborts_and_frees_blocks(served, caplog):
    _, url, _, _, engine = served
    inputs = [[(11 * i + j) % 900 + 100 for i in range(60)] for j in range(128)]
    with caplog.at_level("INFO", logger="pagedllm"):
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes
            httpx.post(f"{url}/v1/embeddings", json={"input": inputs}, timeout=0.02)
        wait_until(lambda: "request aborted" in caplog.text, "the abort's log line", interval=0.02)

    def idle() -> bool:
        return not (engine.has_unfinished_requests() or engine.get_stats()["kv_cache_usage"])

    wait_until(idle, engine.get_stats, interval=0.02)


def _metrics(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("pagedllm:") and "{" in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_metrics_count_embedding_requests(served):
    client, url, _, _, _ = served
    before = _metrics(url)
    out = client.embeddings.create(model="m", input=TEXTS)

    def grew(prefix: str) -> float:
        after = _metrics(url)
        return sum(v - before.get(k, 0.0) for k, v in after.items() if k.startswith(prefix))

    assert grew("pagedllm:prompt_tokens_total") == out.usage.prompt_tokens
    assert grew("pagedllm:request_success_total") == len(TEXTS)
    assert grew("pagedllm:generation_tokens_total") == 0
    assert grew("pagedllm:e2e_request_latency_seconds_count") == len(TEXTS)
