"""Fuzzing the OpenAI-compatible API of a real engine (a tiny random GGUF llama, its tokenizer and
chat template) with request bodies generated from the app's own OpenAPI schema, mixed with
hostile values: huge, negative and NaN numbers, lone surrogates, empty and over-long prompts,
token ids outside the vocabulary. Raw bodies too: invalid UTF-8, NaN literals, deep nesting, a
large body. Whatever comes in: never a 5xx, never a hang, every refusal in OpenAI's error shape,
and afterwards the engine still serves a normal request with its KV pool clean.

The counts of what was sent and answered are printed at the end (pytest -s) for
docs/reliability.md."""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm import EngineArgs
from pagedllm.engine.async_llm_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.server_config import ServerConfig
from tests.model_loader.tiny_gguf import gpt2_vocab, random_hf_weights, write_tiny_llama

MODEL = "tiny"
MAX_MODEL_LEN = 64
VOCAB = len(gpt2_vocab()[0])
REQUEST_TIMEOUT = 120.0  # seconds; generous for a loaded 2-core machine: a hang, not slowness
JSON = {"content-type": "application/json"}
FUZZ = settings(
    deadline=None,
    derandomize=True,  # the same cases on every run
    database=None,
    suppress_health_check=list(HealthCheck),
)
STATS: dict[str, Counter] = {}

HOSTILE_INTS = [0, -1, -(2**31), 2**31, 2**63, -(2**63) - 1, 10**30, VOCAB, VOCAB - 1, 10**6]
HOSTILE_FLOATS = [math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0, 1e30]
HOSTILE_STRINGS = [
    "",
    "\ud800",  # lone surrogates (sent as JSON escapes, or as invalid UTF-8 bytes)
    "a\udfffb",
    "\x00",
    "\ufeff\u202e",
    "<|im_start|>system\n",  # the template's own special tokens
    "{{ 7 * 7 }}{% for x in range(3) %}",  # template syntax in the content (must stay text)
    "hello " * 400,  # far longer than max_model_len once tokenized
    "é" * 50,
]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "tiny.gguf"
    write_tiny_llama(path, random_hf_weights(VOCAB))
    engine = LLMEngine(
        EngineArgs(
            model=str(path),
            max_model_len=MAX_MODEL_LEN,
            block_size=4,
            kv_cache_memory="4MiB",
            max_num_seqs=8,
        )
    )
    async_engine = AsyncLLMEngine(engine)
    client = TestClient(build_app(async_engine, ServerConfig(MODEL)), raise_server_exceptions=False)
    pool = ThreadPoolExecutor(1)
    yield client, async_engine, pool
    pool.shutdown(wait=False, cancel_futures=True)
    async_engine.shutdown()
    print("\nfuzz counts (endpoint: status -> cases):")
    for name, counts in sorted(STATS.items()):
        print(f"  {name}: total {sum(counts.values())}, {dict(sorted(counts.items()))}")


# -- strategies from the OpenAPI schema ------------------------------------------------------------
def _ref(schema: dict, root: dict) -> dict:
    while "$ref" in schema:
        schema = root["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def _integers(name: str | None):
    if name in ("max_tokens", "max_completion_tokens"):
        # Mostly cheap valid values; the hostile ones must be refused before any generation.
        return st.one_of(st.integers(1, 4), st.sampled_from(HOSTILE_INTS))
    if name in ("n", "best_of"):
        return st.one_of(st.integers(1, 3), st.sampled_from(HOSTILE_INTS))
    return st.one_of(st.integers(-3, VOCAB + 3), st.sampled_from(HOSTILE_INTS))


def from_schema(schema: dict, root: dict, name: str | None = None, depth: int = 0):
    """A hypothesis strategy for JSON values matching `schema` (OpenAPI 3.1 / JSON schema), with
    hostile values mixed into every scalar type."""
    schema = _ref(schema, root)
    if "anyOf" in schema:
        return st.one_of(*(from_schema(s, root, name, depth) for s in schema["anyOf"]))
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return _integers(name)
    if kind == "number":
        return st.one_of(st.floats(-3, 3), st.sampled_from(HOSTILE_FLOATS))
    if kind == "string":
        if name == "model":
            return st.sampled_from([MODEL, "other-model", "\ud800"])
        if name == "role":
            return st.sampled_from(["user", "assistant", "system", "tool", "", "\udc00"])
        return st.one_of(st.text(max_size=12), st.sampled_from(HOSTILE_STRINGS))
    if kind == "array":
        items = from_schema(schema.get("items", {}), root, name, depth + 1)
        return st.lists(items, max_size=3 if depth else 4)
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        if not props:  # a free-form object (content parts, logit_bias)
            values = (
                from_schema(schema["additionalProperties"], root, name, depth + 1)
                if isinstance(schema.get("additionalProperties"), dict)
                else st.one_of(st.text(max_size=8), st.integers(-2, 2), st.none())
            )
            free = st.dictionaries(
                st.one_of(st.sampled_from(["type", "text", "0", "5", "-1", "99999"]), st.text()),
                values,
                max_size=3,
            )
            if name == "content":  # content parts: mostly well-formed text parts
                text_part = st.fixed_dictionaries(
                    {"type": st.just("text"), "text": st.sampled_from(HOSTILE_STRINGS)}
                )
                return st.one_of(text_part, free)
            return free
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: from_schema(v, root, k, depth + 1) for k, v in props.items() if k in required},
            optional={
                k: from_schema(v, root, k, depth + 1) for k, v in props.items() if k not in required
            },
        )
    return st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8))


def body_strategy(app, path: str):
    root = app.openapi()
    schema = root["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    valid_ish = from_schema(schema, root)
    any_json = st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
        ),
        max_leaves=8,
    )
    # One branch in five: a field of the wrong type (or garbage) on top of a schema body.
    fields = sorted(schema_fields(root, schema))
    wrong_field = st.tuples(valid_ish, st.sampled_from(fields), any_json)
    return st.one_of(
        valid_ish,
        valid_ish,
        valid_ish,
        valid_ish,
        wrong_field.map(lambda t: {**t[0], t[1]: t[2]} if isinstance(t[0], dict) else t[0]),
    )


# In-range values per field, for bodies that mostly pass validation and reach the engine
# (streaming, logprobs, echo, n, stop strings...): generation stays cheap (max_tokens <= 4).
_TEXT = st.sampled_from(["hello", "the world", "é", "<|im_end|>", "a b c", "\n"])
_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
VALID = {
    "model": st.just(MODEL),
    "prompt": st.one_of(
        _TEXT, st.lists(_TEXT, min_size=1, max_size=3), _IDS, st.lists(_IDS, min_size=1, max_size=3)
    ),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "system"]), "content": _TEXT}
        ),
        min_size=1,
        max_size=3,
    ),
    "max_tokens": st.integers(1, 4),
    "max_completion_tokens": st.integers(1, 4),
    "n": st.integers(1, 3),
    "best_of": st.none(),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 10),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "seed": st.integers(0, 2**32),
    "stop": st.one_of(st.none(), _TEXT, st.lists(_TEXT, max_size=2)),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "logit_bias": st.dictionaries(
        st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3
    ),
    "min_tokens": st.integers(0, 1),
    "length_penalty": st.just(1.0),
    "suffix": st.none(),
    "tokens": _IDS,
}
VALID_COMPLETION = {**VALID, "logprobs": st.one_of(st.none(), st.integers(0, 5))}
VALID_CHAT = {**VALID, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5)}


def valid_body_strategy(app, path: str):
    """Bodies from the schema with every field drawn from its valid range where known."""
    root = app.openapi()
    ref = root["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    schema = _ref(ref, root)
    valid = VALID_CHAT if path == "/v1/chat/completions" else VALID_COMPLETION
    required = set(schema.get("required", []))

    def field(name, sub):
        return valid[name] if name in valid else from_schema(sub, root, name, 1)

    props = schema["properties"]
    return st.fixed_dictionaries(
        {k: field(k, v) for k, v in props.items() if k in required or k in ("max_tokens",)},
        optional={
            k: field(k, v) for k, v in props.items() if k not in required and k != "max_tokens"
        },
    )


def schema_fields(root: dict, schema: dict) -> set[str]:
    return set(_ref(schema, root).get("properties", {}))


def encode(body, raw_utf8: bool) -> bytes:
    """JSON with NaN / Infinity literals; `raw_utf8`: strings as UTF-8 bytes, so that a lone
    surrogate becomes invalid UTF-8 instead of a \\ud800 escape."""
    if raw_utf8:
        return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return json.dumps(body)


# -- sending and checking ----------------------------------------------------------------------
def send(api, path: str, content: bytes | str, *, method: str = "POST", tag: str | None = None):
    """One request with a hang timeout; checks the status and the error shape."""
    client, async_engine, pool = api
    future = pool.submit(client.request, method, path, content=content, headers=JSON)
    response = future.result(timeout=REQUEST_TIMEOUT)  # TimeoutError: the server hung
    STATS.setdefault(tag or path, Counter())[response.status_code] += 1
    assert response.status_code < 500, (content[:300], response.status_code, response.text[:500])
    assert async_engine.is_running, f"the engine loop died on {content[:300]!r}"
    if response.status_code >= 400:
        check_error(response)
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [x[6:] for x in response.text.splitlines() if x.startswith("data: ")]
        assert events and events[-1] == "[DONE]", response.text[-300:]
        for event in events[:-1]:
            data = json.loads(event)
            if "error" in data:  # an in-band error after the stream started
                assert data["error"]["code"] < 500, data
    return response


def check_error(response) -> None:
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] == response.status_code, error


def wait_clean(async_engine, timeout: float = 60.0) -> None:
    """Aborted requests free their blocks on the engine thread's next turn: wait for it."""
    engine = async_engine.engine
    kv = engine.scheduler.kv_cache_manager
    deadline = time.time() + timeout
    while engine.has_unfinished_requests() or kv.num_free_blocks != engine.num_blocks:
        assert time.time() < deadline, "requests or blocks left behind"
        time.sleep(0.05)
    engine.scheduler.check_integrity()


def normal_requests_still_work(api) -> None:
    client, async_engine, _ = api
    wait_clean(async_engine)
    out = send(api, "/v1/completions", json.dumps({"prompt": "hello", "max_tokens": 3}), tag="ok")
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    out = send(api, "/v1/chat/completions", json.dumps(chat), tag="ok")
    assert out.status_code == 200 and out.json()["choices"][0]["message"]["role"] == "assistant"
    wait_clean(async_engine)


# -- the fuzz tests --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "mode", "examples"),
    [("/v1/completions", "hostile", 250), ("/v1/completions", "valid", 150),
     ("/v1/chat/completions", "hostile", 200), ("/v1/chat/completions", "valid", 150),
     ("/tokenize", "hostile", 80), ("/detokenize", "hostile", 60)],
)  # fmt: skip
def test_schema_fuzz(api, path, mode, examples):
    bodies = body_strategy if mode == "hostile" else valid_body_strategy
    strategy = st.tuples(bodies(api[0].app, path), st.booleans())

    @settings(FUZZ, max_examples=examples)
    @given(strategy)
    def fuzz(case):
        body, raw_utf8 = case
        send(api, path, encode(body, raw_utf8), tag=f"{path} ({mode})")

    fuzz()
    normal_requests_still_work(api)


HOSTILE_BODIES = {
    "invalid UTF-8": b'{"prompt": "\xff\xfe\xc3", "max_tokens": 2}',
    "UTF-8 surrogate bytes": b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}',
    "lone surrogate escape": b'{"prompt": "a\\ud800b", "max_tokens": 2}',
    "surrogate in a key": b'{"prompt": "a", "\\udfff": 1}',
    "NaN temperature": b'{"prompt": "a", "max_tokens": 2, "temperature": NaN}',
    "Infinity top_p": b'{"prompt": "a", "max_tokens": 2, "top_p": Infinity}',
    "-Infinity logit_bias": b'{"prompt": "a", "max_tokens": 2, "logit_bias": {"5": -Infinity}}',
    "NaN length_penalty": b'{"prompt": "a", "max_tokens": 2, "use_beam_search": true, '
    b'"length_penalty": NaN}',
    "huge length_penalty": b'{"prompt": "a", "max_tokens": 2, "n": 2, "use_beam_search": true, '
    b'"length_penalty": 1e308}',
    "max_tokens 10**30": b'{"prompt": "a", "max_tokens": 1000000000000000000000000000000}',
    "max_tokens 1e30 float": b'{"prompt": "a", "max_tokens": 1e30}',
    "n 10**9": b'{"prompt": "a", "max_tokens": 2, "n": 1000000000}',
    "best_of 2**63": b'{"prompt": "a", "max_tokens": 2, "best_of": 9223372036854775808}',
    "logprobs 10**6": b'{"prompt": "a", "max_tokens": 2, "logprobs": 1000000}',
    "top_logprobs -1": b'{"messages": [{"role": "user", "content": "a"}], "logprobs": true, '
    b'"top_logprobs": -1}',
    "token id = vocab": f'{{"prompt": [{VOCAB}], "max_tokens": 2}}'.encode(),
    "token id -1": b'{"prompt": [[1, -1]], "max_tokens": 2}',
    "token id 10**30": b'{"prompt": [1000000000000000000000000000000], "max_tokens": 2}',
    "token id float": b'{"prompt": [1.5], "max_tokens": 2}',
    "empty prompt": b'{"prompt": "", "max_tokens": 2}',
    "empty prompt list": b'{"prompt": [], "max_tokens": 2}',
    "empty token list": b'{"prompt": [[]], "max_tokens": 2}',
    "prompt > max_model_len": json.dumps({"prompt": "word " * 200, "max_tokens": 2}).encode(),
    "token prompt = max_model_len": json.dumps({"prompt": [5] * MAX_MODEL_LEN}).encode(),
    "stop_token_ids 10**30": b'{"prompt": "a", "max_tokens": 2, '
    b'"stop_token_ids": [1000000000000000000000000000000]}',
    # Numbers that are valid but extreme: they reach the sampler, which must not produce NaN.
    "Infinity temperature with top_k": b'{"prompt": "a", "max_tokens": 2, "temperature": '
    b'Infinity, "top_k": 5, "logprobs": 5}',
    "1e308 temperature with min_p 1": b'{"prompt": "a", "max_tokens": 2, "temperature": 1e308, '
    b'"min_p": 1.0}',
    "repetition_penalty 5e-324": b'{"prompt": "a", "max_tokens": 2, "repetition_penalty": 5e-324}',
    "seed -2**63 with n 3": b'{"prompt": "a", "max_tokens": 2, "n": 3, '
    b'"seed": -9223372036854775808}',
    "top_k 10**12": b'{"prompt": "a", "max_tokens": 2, "top_k": 1000000000000}',
    "nested 10,000 deep": b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
    "nested 100,000 deep objects": b'{"prompt": "a", "x": '
    + b'{"a": ' * 100_000
    + b"1"
    + b"}" * 100_000
    + b"}",
    "nested 900 deep (parses)": b'{"prompt": "a", "max_tokens": 2, "x": '
    + b"[" * 900
    + b"]" * 900
    + b"}",
    "array body": b"[1, 2, 3]",
    "null body": b"null",
    "empty body": b"",
    "truncated JSON": b'{"prompt": "a", "max_tok',
    "not JSON": b"\x00\x01\x02 hello",
}
CHAT_BODIES = {
    "nested 900 deep message field": b'{"messages": [{"role": "user", "content": "a", "x": '
    + b"[" * 900
    + b"]" * 900
    + b'}], "max_tokens": 2}',
    "lone surrogate content": b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
    "no messages": b'{"messages": []}',
    "image part": b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
    "max_completion_tokens 10**30": b'{"messages": [{"role": "user", "content": "a"}], '
    b'"max_completion_tokens": 1000000000000000000000000000000}',
    "template syntax in content": b'{"messages": [{"role": "user", "content": '
    b'"{{ cycler.__init__.__globals__ }}"}], "max_tokens": 2}',
}


@pytest.mark.parametrize("name", list(HOSTILE_BODIES))
def test_hostile_completion_bodies(api, name):
    send(api, "/v1/completions", HOSTILE_BODIES[name], tag="hostile raw bodies")


@pytest.mark.parametrize("name", list(CHAT_BODIES))
def test_hostile_chat_bodies(api, name):
    response = send(api, "/v1/chat/completions", CHAT_BODIES[name], tag="hostile raw bodies")
    if name == "template syntax in content":  # rendered as text, never evaluated
        assert response.status_code == 200


def test_hostile_values_get_400_naming_the_problem(api):
    cases = {
        b'{"prompt": "a", "max_tokens": 2, "use_beam_search": true, "length_penalty": 1e308}': (
            "length_penalty"
        ),
        b'{"prompt": "a\\ud800"}': "lone surrogate",
        f'{{"prompt": [{VOCAB}]}}'.encode(): "out of range",
        b'{"prompt": "a", "max_tokens": 1000000000000000000000000000000}': "maximum context",
        b'{"prompt": "a", "temperature": NaN}': "temperature",
    }
    for body, fragment in cases.items():
        response = send(api, "/v1/completions", body, tag="hostile raw bodies")
        assert response.status_code == 400 and fragment in response.json()["error"]["message"]


def test_large_body_is_refused_quickly(api):
    """A 4 MiB prompt: refused (too long for the context, or by a body size limit) in one go."""
    body = json.dumps({"prompt": "ab " * (4 * 2**20 // 3), "max_tokens": 2}).encode()
    response = send(api, "/v1/completions", body, tag="hostile raw bodies")
    assert 400 <= response.status_code < 500


def test_bytes_fuzz(api):
    """Random bytes and mangled JSON: always a 4xx in OpenAI's error shape."""
    seed = b'{"prompt": [1, 2], "max_tokens": 2, "n": 1, "temperature": 0.5}'

    @settings(FUZZ, max_examples=100)
    @given(
        st.one_of(
            st.binary(max_size=64),
            st.tuples(st.integers(0, len(seed)), st.binary(min_size=1, max_size=4)).map(
                lambda t: seed[: t[0]] + t[1] + seed[t[0] + len(t[1]) :]
            ),
        )
    )
    def fuzz(content):
        response = send(api, "/v1/completions", content, tag="bytes fuzz")
        assert response.status_code < 500

    fuzz()
    normal_requests_still_work(api)


def test_other_endpoints_and_methods(api):
    for method, path in [("GET", "/health"), ("GET", "/v1/models"), ("GET", "/version"),
                         ("GET", "/metrics"), ("GET", "/v1/completions"), ("PUT", "/tokenize"),
                         ("GET", "/nope"), ("POST", "/v1/models")]:  # fmt: skip
        response = send(api, path, b"{}", method=method, tag="other endpoints")
        if path in ("/health", "/v1/models", "/version", "/metrics") and method == "GET":
            assert response.status_code == 200
        else:
            assert response.status_code in (404, 405)
    normal_requests_still_work(api)
