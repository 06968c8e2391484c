"""Chat templates are untrusted code that ships inside model files. GGUF files whose
tokenizer.chat_template carries the public template-injection payloads (reaching `os` through
jinja's globals: cycler, joiner, lipsum, namespace, self._TemplateReference__context, attr
chains...) are refused at load, or stopped at render for payloads that build their attribute
names at run time; nothing they would do happens. Each payload first runs in a plain,
unsandboxed jinja2 Environment to prove that it really would create the file or set the
variable."""

from __future__ import annotations

import os

import jinja2
import pytest
from fastapi.testclient import TestClient
from jinja2.exceptions import SecurityError

from pagedllm import EngineArgs
from pagedllm.engine.async_llm_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.cli import main
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.server_config import ServerConfig
from pagedllm.model_loader import load_gguf
from pagedllm.model_loader.chat_template import ChatTemplateSecurityError

from .tiny_gguf import gpt2_vocab, random_hf_weights, write_tiny_llama

ENV_VAR = "PAGEDLLM_TEMPLATE_PWNED"
TOUCH = "popen('touch MARKER').read()"  # the command each payload tries to run
# Payloads that name a Python internal literally: refused when the file is loaded.
LITERAL = {
    "cycler globals": "{{ cycler.__init__.__globals__.os.TOUCH }}",
    "joiner globals env": "{{ joiner.__init__.__globals__['os'].environ.update(ENVVAR='1') }}",
    "namespace globals": "{{ namespace.__init__.__globals__.os.TOUCH }}",
    "self context": "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.TOUCH }}",
    "lipsum globals": "{{ lipsum.__globals__['os'].TOUCH }}",
    "attr filter chain": "{{ (cycler|attr('__init__')|attr('__globals__'))['os'].TOUCH }}",
    "builtins import": "{{ lipsum.__globals__.__builtins__.__import__('os').TOUCH }}",
    "subclasses walk": "{% for c in ''.__class__.__mro__[1].__subclasses__() %}"
    "{% if c.__name__ == 'Popen' %}{{ c(['touch', 'MARKER']).wait() }}{% endif %}{% endfor %}",
    "namespace dunder set": "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "inside a normal template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ lipsum.__globals__['os'].TOUCH }}{% endif %}",
}
# Payloads that build the names at run time (no static check can see them): stopped by the
# sandbox at render.
RUNTIME = {
    "concatenated names": "{{ (cycler|attr('__in' ~ 'it__')|attr('__glo' ~ 'bals__'))"
    "['os'].TOUCH }}",
    "name in a variable": "{% set g = '__glo' ~ 'bals__' %}{% set i = '__in' ~ 'it__' %}"
    "{{ (joiner|attr(i)|attr(g))['os'].environ.setdefault('ENVVAR', '1') }}",
    "str.format fields": "{{ '{0.__init__.__globals__[os].environ}'.format(cycler) }}",
}
# Not code execution, but a file that takes the server down: memory and time bombs.
BOMBS = {
    "string bomb": "{{ 'x' * 10000000000 }}",
    "list bomb": "{{ [1] * 10 ** 9 }}",
    "range bomb": "{% for i in range(10 ** 10) %}x{% endfor %}",
    "power bomb": "{{ 7 ** 99999999 }}",
    "mutating messages": "{{ messages.append({'role': 'system', 'content': 'x'}) }}",
}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def marker(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    path = tmp_path / "pwned"
    yield path
    assert not path.exists(), "a template payload ran a command"
    assert ENV_VAR not in os.environ, "a template payload set an environment variable"


def _payload(template: str, marker) -> str:
    return (
        template.replace("TOUCH", TOUCH).replace("MARKER", str(marker)).replace("ENVVAR", ENV_VAR)
    )


def _write(tmp_path, template: str):
    return write_tiny_llama(
        tmp_path / "hostile.gguf", random_hf_weights(len(gpt2_vocab()[0])), chat_template=template
    )


def _would_run(template: str, tmp_path, monkeypatch) -> bool:
    """Render without a sandbox: does the payload really create its file / set the variable?"""
    probe = tmp_path / "probe"
    monkeypatch.delenv(ENV_VAR, raising=False)
    try:
        jinja2.Environment().from_string(_payload(template, probe)).render(
            messages=MESSAGES, add_generation_prompt=True
        )
    except Exception:  # noqa: BLE001 - only the side effect matters
        pass
    ran = probe.exists() or ENV_VAR in os.environ
    probe.unlink(missing_ok=True)
    monkeypatch.delenv(ENV_VAR, raising=False)
    return ran


@pytest.mark.parametrize("name", list(LITERAL))
def test_literal_payload_refused_at_load(tmp_path, monkeypatch, marker, name):
    if name != "namespace dunder set":  # that one only tampers with jinja's namespace
        assert _would_run(LITERAL[name], tmp_path, monkeypatch), "the payload is not a real one"
    path = _write(tmp_path, _payload(LITERAL[name], marker))
    with pytest.raises(ChatTemplateSecurityError) as info:
        load_gguf(path)
    message = str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, SecurityError)
    assert str(path) in message and "template-injection" in message and "'__" in message


@pytest.mark.parametrize("name", list(RUNTIME))
def test_runtime_payload_stopped_at_render(tmp_path, monkeypatch, marker, name):
    if name != "str.format fields":  # that one reads os.environ out instead
        assert _would_run(RUNTIME[name], tmp_path, monkeypatch), "the payload is not a real one"
    tokenizer = load_gguf(_write(tmp_path, _payload(RUNTIME[name], marker))).tokenizer
    with pytest.raises(ChatTemplateSecurityError, match="not allowed|was stopped"):
        tokenizer.apply_chat_template(MESSAGES)


@pytest.mark.parametrize("name", list(BOMBS))
def test_bombs_stopped_at_render(tmp_path, name):
    tokenizer = load_gguf(_write(tmp_path, BOMBS[name])).tokenizer
    with pytest.raises(ChatTemplateSecurityError):
        tokenizer.apply_chat_template(MESSAGES)


def test_cli_refuses_the_file_with_a_clear_error(tmp_path, marker, capsys):
    path = _write(tmp_path, _payload(LITERAL["cycler globals"], marker))
    code = main(["generate", "--model", str(path), "--kv-cache-memory", "1MiB", "hi"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and str(path) in err and "'__" in err
    assert "Traceback" not in err


def test_server_answers_400_and_keeps_serving(tmp_path, marker):
    template = _payload(RUNTIME["concatenated names"], marker)
    engine = LLMEngine(
        EngineArgs(model=str(_write(tmp_path, template)), max_model_len=64, kv_cache_memory="1MiB")
    )
    async_engine = AsyncLLMEngine(engine)
    try:
        client = TestClient(
            build_app(async_engine, ServerConfig("tiny")), raise_server_exceptions=False
        )
        for path, body in [
            ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "stream": True}),
            ("/tokenize", {"messages": MESSAGES}),
        ]:
            response = client.post(path, json=body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert "not allowed" in error["message"] and error["param"] == "messages"
        ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200 and async_engine.is_running
        # A literal payload given with --chat-template is refused per request just the same.
        hostile = _payload(LITERAL["lipsum globals"], marker)
        client = TestClient(build_app(async_engine, ServerConfig("tiny", chat_template=hostile)))
        response = client.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert response.status_code == 400 and "template-injection" in response.text
    finally:
        async_engine.shutdown()
