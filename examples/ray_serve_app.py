"""pagedllm behind Ray Serve: each replica of the `PagedLLM` deployment holds one engine and
serves pagedllm's own FastAPI app (the whole OpenAI-compatible API: /v1/completions,
/v1/chat/completions, /v1/models, /metrics, ...) as its ingress; Serve's HTTP proxy spreads the
requests over the replicas. Needs `pip install "ray[serve]>=2.60"` (the Ray it was tested with:
its serve.ingress() lets each replica build its app once its engine exists). From the
repository root:

    serve run examples.ray_serve_app:build_app model=SmolLM2-135M-Instruct num_replicas=2 \
        num_cpus=4 max_model_len=2048 kv_cache_memory=1GiB

then, with the openai client (the served model's name is `model` unless served_model_name=...):

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of "
                                    "France is", max_tokens=16, temperature=0)
    print(out.choices[0].text)

`curl http://127.0.0.1:8000/replica` says which replica answered (pid, Serve's replica id, torch
threads, tokens its engine generated). Arguments (key=value): num_replicas (default 1), num_cpus
(Ray CPUs per replica, default 1; its torch threads, at least 1), served_model_name, api_key,
and any engine flag of `pagedllm serve` by its name: model, max_model_len, kv_cache_memory,
dtype, enable_prefix_caching=false...

The engine is an AsyncLLMEngine over an LLMEngine in the replica's own process (its step loop on
a thread), not EngineCoreClient's separate engine process: a Ray actor already is a process of
its own with its CPUs reserved, and Serve replaces a replica whose engine died (check_health
below asks the engine loop). A second process per replica would sit outside Ray's CPU
accounting, and a killed actor (ray.kill, a lost node) gives its client no chance to stop it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from ray import serve

from pagedllm.config import EngineArgs
from pagedllm.entrypoints.cli import add_engine_args, engine_args_from
from pagedllm.entrypoints.openai.server_config import ServerConfig

DEPLOYMENT_KEYS = ("num_replicas", "num_cpus", "served_model_name", "api_key")


try:  # late-bound: each replica builds its app after __init__, in __serve_build_asgi_app__
    late_bound_ingress = serve.ingress()
except TypeError as e:  # an older Ray, whose ingress takes the app up front
    raise ImportError("this example needs a newer Ray: pip install 'ray[serve]>=2.60'") from e


@serve.deployment(health_check_period_s=10, health_check_timeout_s=30)
@late_bound_ingress
class PagedLLM:
    def __init__(self, args: EngineArgs, config: ServerConfig, num_cpus: float) -> None:
        import torch

        from pagedllm.engine.async_llm_engine import AsyncLLMEngine
        from pagedllm.engine.llm_engine import LLMEngine

        # The replica's Ray CPUs are its compute threads (replicas on one node share its cores).
        torch.set_num_threads(max(1, int(num_cpus)))
        self.config = config
        self.engine = AsyncLLMEngine(LLMEngine(args))

    def __serve_build_asgi_app__(self):
        from pagedllm.entrypoints.openai.api_server import build_app

        app = build_app(self.engine, self.config)

        @app.get("/replica")
        async def replica() -> dict:
            import torch

            stats = self.engine.engine.get_stats()
            return {"pid": os.getpid(),
                    "replica_id": serve.get_replica_context().replica_id.unique_id,
                    "torch_threads": torch.get_num_threads(),
                    "generated_tokens": stats["num_generation_tokens_total"]}  # fmt: skip

        return app

    def check_health(self) -> None:
        """Serve's periodic probe: raising marks the replica unhealthy and Serve replaces it."""
        self.engine.check_health()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def engine_args(options: dict[str, Any]) -> EngineArgs:
    """EngineArgs from key=value texts (or Python values), read by `pagedllm serve`'s own
    engine flags, so the types, defaults and checks are the command line's."""
    flags = {f.name: f.metadata for f in dataclasses.fields(EngineArgs) if "help" in f.metadata}
    unknown = [key for key in options if key.replace("-", "_") not in flags]
    if unknown:
        raise ValueError(f"unknown arguments {unknown}: not {DEPLOYMENT_KEYS} nor engine flags")
    argv: list[str] = []
    for key, value in options.items():
        name = key.replace("-", "_")
        flag, action = "--" + name.replace("_", "-"), flags[name].get("action")
        if action is None:
            argv += [flag, str(value)]
        elif value is True or str(value).lower() in ("1", "true", "yes", "on"):
            argv.append(flag)
        elif action is argparse.BooleanOptionalAction:
            argv.append("--no-" + flag[2:])
    parser = argparse.ArgumentParser(prog="build_app", add_help=False, exit_on_error=False)
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(argv))  # a bad value: argparse.ArgumentError
    args.validate()
    return args


def build_app(args: dict[str, Any]) -> serve.Application:
    """Serve's application builder: `serve run examples.ray_serve_app:build_app key=value ...`
    (or serve.run(build_app({...})) from Python)."""
    options = dict(args)
    deployment = {key: options.pop(key) for key in DEPLOYMENT_KEYS if key in options}
    num_cpus = float(deployment.get("num_cpus", 1))  # Ray's CPUs may be fractions
    config = ServerConfig(
        served_model_name=deployment.get("served_model_name") or options.get("model"),
        api_key=deployment.get("api_key"),
    )
    return PagedLLM.options(
        num_replicas=int(deployment.get("num_replicas", 1)),
        ray_actor_options={"num_cpus": num_cpus},
    ).bind(engine_args(options), config, num_cpus)
