"""The OpenAI-compatible HTTP server: `build_app(engine, config)` and `run_server(engine, config)`,
a ServerConfig (server_config.py) saying how."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import logging
import os
import signal
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.protocol import EngineClient
from pagedllm.engine.request_checks import check_vocab
from pagedllm.entrypoints.openai import connections, dashboard
from pagedllm.entrypoints.openai.connections import BodyLimits
from pagedllm.entrypoints.openai.embedding_protocol import EmbeddingRequest, PoolingRequest
from pagedllm.entrypoints.openai.errors import (
    OpenAIError,
    bad_request_checked,
    error_body,
    error_reason,
)
from pagedllm.entrypoints.openai.lora import LoRARegistry, add_lora_routes
from pagedllm.entrypoints.openai.metrics import EngineStatsCollector, RequestMetrics, log_stats
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.server_config import ServerConfig
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagedllm.entrypoints.openai.serving_messages import add_messages_routes
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.entrypoints.openai.tools import offered_tools
from pagedllm.version import __version__

logger = logging.getLogger("pagedllm")
API_KEY_ENV = "PAGEDLLM_API_KEY"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    message = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
        for e in errors[:5]
    )
    return message, param


def _basic_auth_password(authorization: str) -> bytes:
    """The password of an HTTP Basic `Authorization` header; b"" if it is not one."""
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "basic":
        return b""
    try:
        return base64.b64decode(value.strip(), validate=True).partition(b":")[2]
    except (binascii.Error, ValueError):
        return b""


def build_app(async_engine: EngineClient, config: ServerConfig) -> FastAPI:
    """The app over `async_engine`, as `config` says (its host, port and shutdown timeout are
    run_server's)."""
    config = config.named(async_engine.engine.model_name)
    served_model_name = config.served_model_name
    api_key = config.api_key or os.environ.get(API_KEY_ENV) or None

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        task = None
        if config.log_stats_interval:
            task = asyncio.create_task(log_stats(async_engine.engine, config.log_stats_interval))
        async with dashboard.running(history):
            yield
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan)
    history = dashboard.add_dashboard(app, async_engine) if config.enable_dashboard else None
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(async_engine.engine, served_model_name))
    metrics = RequestMetrics(registry, served_model_name)
    loras = _lora_registry(async_engine, config)
    completions = OpenAIServingCompletion(async_engine, config, metrics, loras)
    chat = OpenAIServingChat(async_engine, config, metrics, loras)
    responses = OpenAIServingResponses(async_engine, config, metrics, loras)
    embeddings = OpenAIServingEmbedding(async_engine, config, metrics, loras)
    app.state.async_engine = async_engine
    app.state.draining = False  # set when a graceful shutdown begins (/ready then says 503)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError):
        metrics.count_error(exc.reason)
        # 503 is "overloaded or stopping": tell clients when to try again.
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        metrics.count_error("bad_request")
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, 400, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        metrics.count_error(error_reason(exc.status_code))
        return JSONResponse(error_body(str(exc.detail), exc.status_code), exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception):
        metrics.count_error("internal")
        logger.exception("request failed", exc_info=exc)
        return JSONResponse(error_body(f"internal error: {exc!r}", 500), status_code=500)

    if api_key:
        open_paths = {"/health", "/ready"}
        if not config.metrics_need_api_key:
            open_paths.add("/metrics")
        # Digests of equal length, compared in constant time: how long a check takes says
        # nothing about the key, not even its length.
        expected = hashlib.sha256(f"Bearer {api_key}".encode()).digest()
        expected_password = hashlib.sha256(api_key.encode()).digest()

        def authorized(path: str, header: str) -> bool:
            if hmac.compare_digest(hashlib.sha256(header.encode()).digest(), expected):
                return True
            if path not in dashboard.DASHBOARD_PATHS:
                return False
            # A browser cannot send a Bearer header when it opens a page: the dashboard also
            # takes HTTP Basic auth with the key as password (any user name).
            password = hashlib.sha256(_basic_auth_password(header)).digest()
            return hmac.compare_digest(password, expected_password)

        @app.middleware("http")
        async def check_api_key(request: Request, call_next):
            path = request.url.path
            if request.method != "OPTIONS" and path not in open_paths:
                # Anthropic's clients send the key as x-api-key instead.
                x_api_key = hashlib.sha256(request.headers.get("x-api-key", "").encode()).digest()
                if not (
                    authorized(path, request.headers.get("authorization", ""))
                    or hmac.compare_digest(x_api_key, expected_password)
                ):
                    metrics.count_error("unauthorized")
                    body = error_body("invalid or missing API key", 401)
                    headers = None  # on the dashboard, the browser asks for the key
                    if path in dashboard.DASHBOARD_PATHS:
                        headers = {"WWW-Authenticate": 'Basic realm="pagedllm", charset="UTF-8"'}
                    return JSONResponse(body, status_code=401, headers=headers)
            return await call_next(request)

    max_body, body_timeout = config.limits.max_request_body_bytes, config.connections.body_timeout
    if max_body is not None or body_timeout is not None:
        # Added last, so outermost: nothing behind it ever reads an unbounded or endless body.
        app.add_middleware(
            BodyLimits, max_bytes=max_body, timeout=body_timeout, on_refused=metrics.count_error
        )
    # Anthropic's Messages API over chat; its error rewriting wraps every middleware above.
    add_messages_routes(app, chat)

    @app.get("/health")
    async def health():
        if not async_engine.is_running:
            return JSONResponse(error_body("the engine loop has stopped", 503), 503)
        if async_engine.is_restarting:
            return JSONResponse(error_body("the engine is restarting", 503), 503)
        return Response(status_code=200)

    @app.get("/ready")
    async def ready():
        """Readiness, for load balancers and Kubernetes: /health's answer, and also 503 from
        the moment the server starts to drain (SIGTERM), so no new request is routed here."""
        if app.state.draining:
            return JSONResponse(error_body("the server is shutting down", 503), 503)
        return await health()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        card = ModelCard(
            id=served_model_name,
            root=async_engine.engine.args.model or async_engine.engine.model_name,
            max_model_len=async_engine.engine.max_model_len,
        )
        adapters = [] if loras is None else loras.cards(card.max_model_len)
        return ModelList(data=[card, *adapters])

    if loras is not None and config.allow_runtime_lora_updating:
        add_lora_routes(app, loras)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        return await completions.create(body, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        return await chat.create(body, request)

    @app.post("/v1/embeddings")
    async def create_embedding(body: EmbeddingRequest, request: Request):
        return await embeddings.create(body, request)

    @app.post("/pooling")
    async def create_pooling(body: PoolingRequest, request: Request):
        return await embeddings.create(body, request, pooling=True)

    # OpenAI's Responses API, translated onto chat (its stored responses live in `responses`)
    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        return await responses.create_response(body, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return responses.retrieve(response_id)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        chat.check_model(body.model)
        tokenizer = chat.tokenizer
        if tokenizer is None:
            raise OpenAIError("this model has no tokenizer")
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("give either prompt or messages", param="prompt")
        if body.messages is not None:
            tools = offered_tools(body.tools, config.tool_call_parser)
            ids = chat.render(body.messages, body.add_generation_prompt, tools)["prompt_token_ids"]
        else:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=chat.max_model_len, tokens=ids)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        # vLLM's: what a client needs to tokenize through /tokenize and render chats itself
        # (lm-evaluation-harness's tokenizer_backend=remote reads eos / bos / pad and the
        # chat template here).
        tokenizer = chat.tokenizer
        if tokenizer is None:
            raise OpenAIError("this model has no tokenizer", 404)
        info = {"tokenizer_class": type(tokenizer).__name__, "vocab_size": tokenizer.vocab_size,
                "model_max_length": chat.max_model_len,
                "chat_template": config.chat_template or tokenizer.chat_template}  # fmt: skip
        for name in ("bos", "eos", "pad", "unk"):
            info[f"{name}_token"] = getattr(tokenizer, f"{name}_token")
            info[f"{name}_token_id"] = getattr(tokenizer, f"{name}_token_id")
        return info

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        chat.check_model(body.model)
        if chat.tokenizer is None:
            raise OpenAIError("this model has no tokenizer")
        with bad_request_checked():
            check_vocab(body.tokens, async_engine.engine.model_config.vocab_size, "tokens")
        return DetokenizeResponse(prompt=chat.tokenizer.decode(body.tokens))

    return app


def _lora_registry(async_engine: EngineClient, config: ServerConfig) -> LoRARegistry | None:
    """The served adapters (--lora-modules, each checked now: a bad one stops the start)."""
    if async_engine.engine.config.lora is None:
        if config.lora_modules or config.allow_runtime_lora_updating:
            raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
        return None
    loras = LoRARegistry(async_engine, config.served_model_name)
    for name, path in config.lora_modules:
        loras.add(name, path)
    return loras


class _Server(uvicorn.Server):
    """uvicorn's server, whose shutdown gives running requests `grace` seconds, then stops the
    engine: open streams end with an error event and [DONE], waiting requests get a 503, so
    every connection closes cleanly instead of being cancelled mid-response."""

    def __init__(self, config: uvicorn.Config, async_engine: EngineClient, grace: float,
                 started: tuple[float, dict[str, float]] | None = None):  # fmt: skip
        super().__init__(config)
        self.async_engine = async_engine
        self.grace = grace
        self.start_phases = started  # not `started`: uvicorn's own flag

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.start_phases is not None and not self.should_exit:
            # Where the time to the first answer goes: imports, the engine (model, kernels, KV
            # pool), the server's own start.
            start, phases = self.start_phases
            total = time.perf_counter() - start
            parts = [f"{name} {seconds:.1f} s" for name, seconds in phases.items()]
            parts.append(f"server {total - sum(phases.values()):.1f} s")
            logger.info("ready in %.1f s: %s", total, ", ".join(parts))

    async def shutdown(self, sockets=None) -> None:
        self.config.app.state.draining = True

        async def stop_engine_later() -> None:
            await asyncio.sleep(self.grace)
            logger.info("stopping the requests still running after %.0f s", self.grace)
            await asyncio.to_thread(self.async_engine.shutdown)

        stopper = asyncio.create_task(stop_engine_later())
        try:
            await super().shutdown(sockets)
        finally:
            stopper.cancel()


def run_server(
    async_engine: EngineClient,
    config: ServerConfig,
    started: tuple[float, dict[str, float]] | None = None,
) -> None:
    """Serve at config.host:config.port until Ctrl-C or SIGTERM (uvicorn's handlers): running
    requests get config.graceful_shutdown_timeout seconds to finish, then the engine loop stops.
    `started`: (time.perf_counter() when the command began, seconds per phase since), logged
    with the server's own share once it listens."""
    config = config.named(async_engine.engine.model_name)
    host, port, grace = config.host, config.port, config.graceful_shutdown_timeout
    app = build_app(async_engine, config)
    # uvicorn cancels what still runs 5 s after the engine stopped (a backstop).
    uvicorn_config = connections.uvicorn_config(
        app, config, host=host, port=port, log_level="info", timeout_graceful_shutdown=grace + 5
    )
    server = _Server(uvicorn_config, async_engine, grace, started)
    logger.info("serving %s at http://%s:%d/v1", config.served_model_name, host, port)
    if config.enable_dashboard:
        logger.info("KV-cache dashboard at http://%s:%d/dashboard", host, port)
    if not async_engine.has_loop_thread:
        _serve_with_the_loop_here(server, async_engine)
    else:
        _serve_here(server, async_engine)
    logger.info("server stopped")


def _serve_here(server: _Server, async_engine: EngineClient) -> None:
    """uvicorn on this thread, the engine loop on its own (or in its own process)."""
    signalled = []

    def _exit(signum, frame):
        signalled.append(signum)
        raise SystemExit(0)

    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then re-raises the signal with the
    # previous handler: this one, so that SIGTERM ends the process with status 0, like Ctrl-C.
    signal.signal(signal.SIGTERM, _exit)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    except SystemExit:
        if not signalled:  # uvicorn's own (the port is taken)
            raise
    finally:
        async_engine.shutdown()


def _serve_with_the_loop_here(server: _Server, async_engine: EngineClient) -> None:
    """The engine loop on this (the main) thread, uvicorn on another (it installs no signal
    handlers off the main thread: these do what its own would). SIGINT or SIGTERM: a graceful
    shutdown (running requests get the grace period, then the loop stops); a second: at once.
    `async_engine`: an AsyncLLMEngine started without its thread (its run_loop)."""

    def _signal(signum, frame):
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _signal)

    failed: list[BaseException] = []  # e.g. SystemExit(1) from uvicorn when the port is taken

    def serve() -> None:
        try:
            server.run()
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            failed.append(e)
        finally:
            async_engine.shutdown(timeout=0)  # the loop, if still running, stops

    http = threading.Thread(target=serve, name="pagedllm-http")
    http.start()
    async_engine.run_loop()
    # The loop stopped: by shutdown (uvicorn is ending) or by a failure (uvicorn goes on
    # answering /health and errors until it is told to stop).
    while http.is_alive():
        http.join(0.5)
    if failed:
        raise failed[0]
