"""`pagedllm bench serve`: an online benchmark against a running `pagedllm serve`.

The synthetic ShareGPT- or Alpaca-shaped workload (token-id prompts, `ignore_eos`, one output
length per request) goes to `/v1/completions` as streams, arriving as a Poisson process at
`--request-rate` (or all at once), at most `--max-concurrency` at a time. Reported like vLLM's
serving benchmark: request and token throughput, time to first token (TTFT), time per output
token after the first (TPOT), inter-token latency (ITL) and end-to-end latency, mean / median /
p99 in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedllm.bench.workload import WORKLOAD_SHAPES, WorkloadRequest, workload_from_tokenizer


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument("--base-url", default="http://127.0.0.1:8000",
                       help="the server (default: http://127.0.0.1:8000)")  # fmt: skip
    group.add_argument("--api-key", default=None, help="Bearer key, if the server wants one")
    group.add_argument("--tokenizer", default=None,
                       help="tokenizer of the served model, for the workload's token ids "
                            "(default: the default model's)")  # fmt: skip
    group.add_argument("--num-prompts", type=int, default=64, help="requests (default: 64)")
    group.add_argument("--workload", choices=WORKLOAD_SHAPES, default="sharegpt",
                       help="length shape (default: sharegpt)")  # fmt: skip
    group.add_argument("--scale", type=float, default=None,
                       help="length scale (default: 0.25 for sharegpt, 1 for alpaca)")  # fmt: skip
    group.add_argument("--workload-seed", type=int, default=0, help="workload seed (default: 0)")
    group.add_argument("--request-rate", type=float, default=math.inf,
                       help="requests per second, Poisson arrivals "
                            "(default: inf, all at once)")  # fmt: skip
    group.add_argument("--max-concurrency", type=int, default=None,
                       help="most requests in flight (default: no bound)")  # fmt: skip
    group.add_argument("--result-json", default=None, help="also write the results here")


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0  # tokens received
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between chunks after the first
    error: str | None = None
    retried: bool = False  # the connection closed before any response: sent again once


async def _send(client, url: str, model: str, request: WorkloadRequest) -> RequestResult:
    prompt, output_len = request
    result = RequestResult(prompt_len=len(prompt))
    body = {
        "model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = last = time.perf_counter()
    for attempt in (0, 1):
        responded = False
        try:
            async with client.stream("POST", url, json=body) as response:
                responded = True
                if response.status_code != 200:
                    head = (await response.aread())[:200]
                    result.error = f"HTTP {response.status_code}: {head!r}"
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        result.error = chunk["error"]["message"]
                        return result
                    now = time.perf_counter()
                    if chunk.get("usage"):
                        result.output_len = chunk["usage"]["completion_tokens"]
                    if not chunk.get("choices"):
                        continue
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
            result.latency = time.perf_counter() - start
            return result
        except Exception as e:  # noqa: BLE001 - a failed request is a result too
            # Closed before any response: a keep-alive connection the server had just closed
            # (llama-server does so now and then), so the request was never read: once more.
            if attempt == 0 and not responded and type(e).__name__ == "RemoteProtocolError":
                result.retried = True
                continue
            result.error = repr(e)
            return result
    return result


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """vLLM's serving metrics over the successful requests; times in milliseconds."""
    ok = [r for r in results if r.error is None]
    out: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "retried": sum(r.retried for r in results),
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": sum(r.output_len for r in ok),
        "request_throughput": len(ok) / duration if duration else 0.0,
    }
    out["output_throughput"] = out["total_output_tokens"] / duration if duration else 0.0
    out["total_token_throughput"] = (
        (out["total_input_tokens"] + out["total_output_tokens"]) / duration if duration else 0.0
    )
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": tpots,
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for name, values in series.items():
        ms = np.asarray(values or [0.0]) * 1000
        out[f"mean_{name}_ms"] = float(ms.mean())
        out[f"median_{name}_ms"] = float(np.median(ms))
        out[f"p99_{name}_ms"] = float(np.percentile(ms, 99))
    out["errors"] = sorted({r.error for r in results if r.error is not None})[:5]
    return out


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"{'Successful requests:':<40}{s['completed']:>12}",
        f"{'Failed requests:':<40}{s['failed']:>12}",
        f"{'Benchmark duration (s):':<40}{s['duration_s']:>12.2f}",
        f"{'Total input tokens:':<40}{s['total_input_tokens']:>12}",
        f"{'Total generated tokens:':<40}{s['total_output_tokens']:>12}",
        f"{'Request throughput (req/s):':<40}{s['request_throughput']:>12.2f}",
        f"{'Output token throughput (tok/s):':<40}{s['output_throughput']:>12.2f}",
        f"{'Total token throughput (tok/s):':<40}{s['total_token_throughput']:>12.2f}",
    ]
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}  # fmt: skip
    for name, title in titles.items():
        lines.append(f"{'-' * 15}{title}{'-' * 15}")
        for stat in ("mean", "median", "p99"):
            label = f"{stat.capitalize() if stat != 'p99' else 'P99'} {name.upper()} (ms):"
            lines.append(f"{label:<40}{s[f'{stat}_{name}_ms']:>12.2f}")
    return "\n".join(lines)


async def run_benchmark(
    base_url: str,
    requests: list[WorkloadRequest],
    model: str,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    api_key: str | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rng = np.random.default_rng(seed)
    url = f"{base_url.rstrip('/')}/v1/completions"
    async with httpx.AsyncClient(headers=headers, timeout=None, limits=limits) as client:

        async def one(request: WorkloadRequest) -> RequestResult:
            if semaphore is None:
                return await _send(client, url, model, request)
            async with semaphore:
                return await _send(client, url, model, request)

        start = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(one(request)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration)


def main(ns: argparse.Namespace) -> int:
    import httpx

    from pagedllm.model_loader.loader import load_tokenizer, resolve_model

    if ns.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {ns.num_prompts}")
    if not ns.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {ns.request_rate}")
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    try:
        models = httpx.get(f"{ns.base_url.rstrip('/')}/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach the server at {ns.base_url}: {e}") from None
    if models.status_code != 200:
        raise ValueError(f"GET /v1/models answered {models.status_code}: {models.text[:200]}")
    card = models.json()["data"][0]
    tokenizer = load_tokenizer(resolve_model(ns.tokenizer))
    requests = workload_from_tokenizer(
        ns.num_prompts, tokenizer, scale=ns.scale, seed=ns.workload_seed,
        max_model_len=card.get("max_model_len"), shape=ns.workload,
    )  # fmt: skip
    print(
        f"{len(requests)} {ns.workload}-shaped requests to {card['id']} at {ns.base_url}, "
        f"rate {ns.request_rate} req/s, concurrency {ns.max_concurrency or 'unbounded'}"
    )
    summary = asyncio.run(
        run_benchmark(
            ns.base_url, requests, card["id"], ns.request_rate, ns.max_concurrency, ns.api_key,
            seed=ns.workload_seed,
        )
    )  # fmt: skip
    print(format_summary(summary))
    for error in summary["errors"]:
        print(f"error: {error}")
    if ns.result_json:
        with open(ns.result_json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), **vars(ns), **summary},
                      f, indent=2, default=str)  # fmt: skip
    return 0 if summary["failed"] == 0 else 1
