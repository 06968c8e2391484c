"""The server's options: `pagedllm serve` fills a ServerConfig from its flags once (cli.py), and
build_app / run_server (api_server.py) read it. The defaults are a library's (no stats lines,
no bound on the queue); the command line's are its flags'."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from pagedllm.sampling_params import MAX_LOGPROBS


@dataclass
class ServerLimits:
    """What one request may ask for (each a `serve` flag): beyond it, a 400 (413 for the body)."""

    max_request_body_bytes: int | None = 8 << 20
    max_n: int = 16  # n, best_of or the beam width: sequences one request runs
    max_logprobs: int = 20  # logprobs / top_logprobs, and the prompt's with echo
    max_stop: int = 64  # stop strings, and stop token ids, each
    max_prompts: int = 128  # prompts in one completions request

    def __post_init__(self) -> None:
        body = self.max_request_body_bytes
        if body is not None and body < 1:
            raise ValueError(f"--max-request-body-bytes must be >= 1, got {body}")
        for name, low in (("max_n", 1), ("max_stop", 0), ("max_prompts", 1)):
            if getattr(self, name) < low:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be >= {low}, got {getattr(self, name)}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"--max-logprobs must be in [0, {MAX_LOGPROBS}] (the engine's limit), "
                f"got {self.max_logprobs}"
            )


@dataclass
class ConnectionLimits:
    """What one connection may hold (each a `serve` flag; connections.py applies them)."""

    limit_concurrency: int | None = None  # connections + requests at once; past it uvicorn's 503
    timeout_keep_alive: float = 5.0  # an idle keep-alive connection is closed after this
    header_timeout: float | None = 10.0  # a request's headers must all arrive within this
    body_timeout: float | None = 60.0  # and its body within this, after the headers
    # a connection's kernel send buffer (the kernel doubles it); None: the kernel's autotuning
    send_buffer_bytes: int | None = 65536

    def __post_init__(self) -> None:
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"--limit-concurrency must be >= 1, got {self.limit_concurrency}")
        flags = {"timeout_keep_alive": "--timeout-keep-alive",
                 "header_timeout": "--timeout-request-header",
                 "body_timeout": "--timeout-request-body"}  # fmt: skip
        for name, flag in flags.items():
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{flag} must be > 0, got {value}")


@dataclass
class ServerConfig:
    """Everything the HTTP server takes besides the engine."""

    served_model_name: str | None = None  # the model's name in the API; None: the engine's
    host: str = "127.0.0.1"
    port: int = 8000
    # With a key, every route but /health needs it (and /metrics unless metrics_need_api_key
    # is False); None: $PAGEDLLM_API_KEY, if set, when the app is built.
    api_key: str | None = None
    metrics_need_api_key: bool = True
    chat_template: str | None = None  # the template's text; None: the tokenizer's
    log_stats_interval: float | None = None  # seconds between stats log lines; None: no lines
    max_waiting_requests: int | None = None  # a request that would queue more gets a 503
    # On Ctrl-C / SIGTERM, seconds running requests get to finish before the engine stops
    graceful_shutdown_timeout: float = 5.0
    limits: ServerLimits = field(default_factory=ServerLimits)
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    log_requests: bool = False  # log each request's prompts and parameters (off: never)
    # tool_choice "auto" allowed, its calls read by the tool_call_parser (hermes or json)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    enable_dashboard: bool = True  # the live KV-cache dashboard (/dashboard, /debug/kv)
    # <think> ... </think> of chat answers into reasoning_content: deepseek_r1 | qwen3 | None
    reasoning_parser: str | None = None
    # LoRA adapters served as model names (name, path), with --enable-lora; and whether
    # /v1/load_lora_adapter and /v1/unload_lora_adapter exist (vLLM gates them likewise)
    lora_modules: list[tuple[str, str]] = field(default_factory=list)
    allow_runtime_lora_updating: bool = False
    # /v1/responses: how many stored responses (store: true) stay in memory for GET and
    # previous_response_id, the least recently used dropped first; 0: none kept
    max_stored_responses: int = 1000

    def named(self, default: str) -> ServerConfig:
        """This config with its served_model_name filled in (`default`: the engine's name)."""
        if self.served_model_name is not None:
            return self
        return dataclasses.replace(self, served_model_name=default)


def _chat_template_arg(value: str | None) -> str | None:
    """--chat-template: a file's path, or the template itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


def server_config_from(ns: argparse.Namespace) -> ServerConfig:
    """`serve`'s own flags as a ServerConfig, checked before the model loads."""
    chat_template = _chat_template_arg(ns.chat_template)
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser (hermes or json)")
    limits = ServerLimits(
        max_request_body_bytes=ns.max_request_body_bytes or None,
        max_n=ns.max_n,
        max_logprobs=ns.max_logprobs,
        max_stop=ns.max_stop,
        max_prompts=ns.max_prompts,
    )
    return ServerConfig(
        served_model_name=ns.served_model_name or ns.model,  # None: the engine's model name
        host=ns.host,
        port=ns.port,
        api_key=ns.api_key,
        metrics_need_api_key=not ns.disable_metrics_auth,
        chat_template=chat_template,
        log_stats_interval=None if ns.disable_log_stats else ns.log_stats_interval,
        max_waiting_requests=ns.max_waiting_requests or None,
        graceful_shutdown_timeout=ns.graceful_shutdown_timeout,
        limits=limits,
        connections=ConnectionLimits(
            ns.limit_concurrency,
            ns.timeout_keep_alive,
            ns.timeout_request_header or None,
            ns.timeout_request_body or None,
            ns.send_buffer_bytes or None,
        ),  # fmt: skip
        log_requests=ns.enable_log_requests,
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
        tool_call_parser=ns.tool_call_parser,
        enable_dashboard=ns.enable_dashboard,
        reasoning_parser=ns.reasoning_parser,
        lora_modules=_lora_modules(ns.lora_modules),
        allow_runtime_lora_updating=ns.allow_runtime_lora_updating,
    )


def _lora_modules(specs: list[str] | None) -> list[tuple[str, str]]:
    from pagedllm.entrypoints.openai.lora import parse_lora_modules

    try:
        return parse_lora_modules(specs)
    except ValueError as e:
        raise SystemExit(str(e)) from None
