"""LoRA adapters through the real HTTP server (uvicorn on loopback, the openai client): adapters
as model names with their parent in /v1/models, each one's text equal to HF + peft's greedy
tokens, an unknown name a 404 in OpenAI's shape, vLLM's load / unload routes at run time (behind
the API key, off unless enabled), an adapter unloaded while its requests stream, which finish
unharmed, bad adapters refused with nothing leaked, and lora_requests_info on /metrics."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from benchmarks.soak_targets import serve_in_thread
from pagedllm.config import EngineArgs
from pagedllm.engine.async_llm_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from tests.conftest import save_tiny_llama
from tests.lora.conftest import ALL, hf_greedy, make_adapter
from tests.waiting import wait_until

KEY = "secret"
PROMPT = [11, 12, 13, 14, 15]
N = 16
LONG = 160  # tokens: still streaming when the adapter is unloaded


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny model with the default model's vocabulary (its tokenizer applies), three adapters
    and HF + peft's greedy tokens for each."""
    root = tmp_path_factory.mktemp("lora-server")
    base = save_tiny_llama(root / "base", vocab_size=49152, max_position_embeddings=512)
    paths, expected = {}, {"base": hf_greedy(base, PROMPT, N)[0]}
    for i, (name, targets, r) in enumerate([("sql", ["q_proj", "v_proj"], 8), ("food", ALL, 4),
                                            ("late", ALL, 16), ("wide", ALL, 32)]):  # fmt: skip
        paths[name] = str(root / name)
        model = make_adapter(base, paths[name], targets, r, 2 * r, seed=20 + i)
        expected[name] = hf_greedy(model, PROMPT, N)[0]
    return str(root / "base"), paths, expected


@pytest.fixture(scope="module")
def server(setup):
    base, paths, _ = setup
    args = EngineArgs(model=base, tokenizer="SmolLM2-135M-Instruct", dtype="float32",
                      max_model_len=256, kv_cache_memory="16MiB", enable_lora=True, max_loras=2,
                      max_lora_rank=16)  # fmt: skip
    engine = AsyncLLMEngine(LLMEngine(args))
    try:
        modules = [("sql", paths["sql"]), ("food", paths["food"])]
        with serve_in_thread(engine, "base", api_key=KEY, lora_modules=modules,
                             allow_runtime_lora_updating=True) as url:  # fmt: skip
            yield url, engine
    finally:
        engine.shutdown()


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def _text(engine, name, expected):
    return engine.engine.tokenizer.decode(expected[name])


def _complete(client, model, **kw):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0,
                                     extra_body={"min_tokens": N}, **kw)  # fmt: skip


def _post(url, route, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/{route}", json=body, headers=headers, timeout=60)


def test_models_list_adapters_with_their_parent(server):
    url, _ = server
    cards = {m.id: m for m in _client(url).models.list().data}
    assert set(cards) >= {"base", "sql", "food"}
    assert cards["sql"].model_extra["parent"] == "base"
    assert cards["base"].model_extra.get("parent") is None


def test_each_model_name_runs_its_adapter(server, setup):
    url, engine = server
    _, _, expected = setup
    client = _client(url)
    for name in ("base", "sql", "food"):
        out = _complete(client, name)
        assert out.model == name
        assert out.choices[0].text == _text(engine, name, expected), name
    streamed = "".join(c.choices[0].text for c in _complete(client, "sql", stream=True))
    assert streamed == _text(engine, "sql", expected)
    chat = client.chat.completions.create(
        model="food", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.model == "food" and chat.choices[0].message.content is not None
    assert len({expected[n][:8].__repr__() for n in ("base", "sql", "food")}) == 3


def test_unknown_model_is_a_404(server):
    url, _ = server
    with pytest.raises(openai.NotFoundError) as e:
        _complete(_client(url), "nope")
    assert e.value.body["type"] == "NotFoundError" and "nope" in e.value.body["message"]


def test_load_and_unload_at_run_time(server, setup):
    url, engine = server
    _, paths, expected = setup
    assert _post(url, "load_lora_adapter", {"lora_name": "late", "lora_path": paths["late"]},
                 key=None).status_code == 401  # fmt: skip
    r = _post(url, "load_lora_adapter", {"lora_name": "late", "lora_path": paths["late"]})
    assert r.status_code == 200, r.text
    assert _complete(_client(url), "late").choices[0].text == _text(engine, "late", expected)
    again = _post(url, "load_lora_adapter", {"lora_name": "late", "lora_path": paths["late"]})
    assert again.status_code == 400 and "already" in again.json()["error"]["message"]
    assert _post(url, "unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(_client(url), "late")
    assert _post(url, "unload_lora_adapter", {"lora_name": "late"}).status_code == 404


@pytest.mark.parametrize(
    "path_of, message",
    [(lambda p: p["wide"], "above --max-lora-rank 16"), (lambda p: p["wide"] + "-none", "no such")],
)
def test_bad_adapters_refused_nothing_leaked(server, setup, path_of, message):
    url, engine = server
    r = _post(url, "load_lora_adapter", {"lora_name": "bad", "lora_path": path_of(setup[1])})
    assert r.status_code == 400 and message in r.json()["error"]["message"]
    assert "bad" not in {m.id for m in _client(url).models.list().data}


def test_unload_while_streaming_finishes_them(server, setup):
    """Eight streams on an adapter; unloaded after their first chunks, they end with the same
    text as undisturbed; a new request for it is a 404 meanwhile; the pool is whole after."""
    url, engine = server
    _, paths, _ = setup
    assert _post(url, "load_lora_adapter", {"lora_name": "busy", "lora_path": paths["food"]}
                 ).status_code == 200  # fmt: skip
    params = dict(prompt=PROMPT, max_tokens=LONG, temperature=0, extra_body={"min_tokens": LONG})
    undisturbed = _client(url).completions.create(model="busy", **params).choices[0].text
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)

    async def stream(started: asyncio.Event) -> str:
        chunks = await client.completions.create(model="busy", stream=True, **params)
        text = []
        async for c in chunks:
            text.append(c.choices[0].text)
            started.set()
        return "".join(text)

    async def run():
        started = asyncio.Event()
        tasks = [asyncio.create_task(stream(started)) for _ in range(8)]
        await started.wait()
        assert sum(not t.done() for t in tasks) > 0, "nothing left streaming to unload under"
        metrics = await asyncio.to_thread(
            httpx.get, f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}
        )
        assert 'running_lora_adapters="busy"' in metrics.text
        r = await asyncio.to_thread(_post, url, "unload_lora_adapter", {"lora_name": "busy"})
        assert r.status_code == 200
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="busy", prompt=PROMPT, max_tokens=2)
        return await asyncio.gather(*tasks)

    texts = asyncio.run(run())
    assert texts == [undisturbed] * 8
    kv = engine.engine.scheduler.kv_cache_manager
    wait_until(lambda: kv.num_free_blocks == engine.engine.num_blocks, "every block freed")


def test_lora_requests_info_on_metrics(server):
    url, _ = server
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    line = next(x for x in text.splitlines() if x.startswith("pagedllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line


def test_runtime_routes_off_unless_enabled(setup):
    base, paths, _ = setup
    args = EngineArgs(model=base, tokenizer="SmolLM2-135M-Instruct", dtype="float32",
                      max_model_len=256, kv_cache_memory="16MiB", enable_lora=True)  # fmt: skip
    engine = AsyncLLMEngine(LLMEngine(args))
    try:
        with serve_in_thread(engine, "base") as url:
            r = _post(url, "load_lora_adapter", {"lora_name": "x", "lora_path": paths["sql"]})
            assert r.status_code == 404
    finally:
        engine.shutdown()


def test_cli_generate_with_lora_and_serve_refusing_a_bad_adapter(setup):
    """`pagedllm generate --lora PATH` prints the adapter's text; `serve` with an adapter it
    cannot run stops at start-up with the reason, no traceback."""
    import subprocess
    import sys

    base, paths, expected = setup
    cli = [sys.executable, "-m", "pagedllm.entrypoints.cli"]
    flags = ["--model", base, "--tokenizer", "SmolLM2-135M-Instruct", "--dtype", "float32",
             "--kv-cache-memory", "16MiB", "--max-model-len", "256"]  # fmt: skip
    from pagedllm import LLM, LoRARequest, SamplingParams

    prompt = "The cat sat on the"
    out = subprocess.run([*cli, "generate", "--raw", "--lora", paths["sql"], "--max-tokens",
                          str(N), "--ignore-eos", *flags, prompt],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    llm = LLM(model=base, tokenizer="SmolLM2-135M-Instruct", dtype="float32",
              kv_cache_memory="16MiB", max_model_len=256, enable_lora=True)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    want = [llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
            for lora in (LoRARequest("sql", 1, paths["sql"]), None)]  # fmt: skip
    assert out.stdout == want[0] + "\n" and want[0] != want[1]
    bad = subprocess.run([*cli, "serve", "--enable-lora", "--lora-modules",
                          f"wide={paths['wide']}", *flags],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2
    assert "above --max-lora-rank 16" in bad.stderr and "Traceback" not in bad.stderr
