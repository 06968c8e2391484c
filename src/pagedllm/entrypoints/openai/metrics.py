"""Prometheus metrics: engine gauges read at scrape time, request histograms as requests end."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagedllm.outputs import RequestOutput

logger = logging.getLogger("pagedllm")
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class EngineStatsCollector:
    """Gauges and counters from `engine.get_stats()`, read at scrape time."""

    def __init__(self, engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        """One sample per engine (data-parallel replica), labelled as vLLM labels them."""
        by_engine = self.engine.engine_stats()
        labels = ["model_name", "engine"]
        values = {rank: [self.model_name, rank] for rank in by_engine}
        gauges = {
            "num_requests_running": ("num_running", "Requests running now."),
            "num_requests_waiting": ("num_waiting", "Requests waiting to be scheduled."),
            "num_requests_swapped": ("num_swapped", "Requests swapped out to CPU memory."),
            "kv_cache_usage_perc": ("kv_cache_usage", "KV-cache usage (1 = full)."),
        }
        counters = {
            "num_preemptions": ("num_preemptions_total", "Preemptions so far."),
            "prefix_cache_queries": ("prefix_cache_queries", "Blocks looked up in the cache."),
            "prefix_cache_hits": ("prefix_cache_hits", "Blocks found in the prefix cache."),
            # an engine in its own process
            "engine_restarts": ("num_engine_restarts_total",
                                "Engine processes restarted after a failure."),
        }  # fmt: skip
        for kind, table in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, (key, doc) in table.items():
                readings = [(r, s[key]) for r, s in by_engine.items() if key in s]
                if readings:
                    metric = kind(f"pagedllm:{name}", doc, labels=labels)
                    for rank, reading in readings:
                        metric.add_metric(values[rank], float(reading))
                    yield metric
        spec = {r: s for r, s in by_engine.items() if "spec_decode_num_drafts" in s}
        if spec:
            yield from _spec_decode_metrics(spec, labels, values)
        lora = self.engine.lora_stats()
        if lora is not None:
            # vLLM's / the Gateway API inference extension's: the adapters in the labels, the
            # time of the reading as the value; a router reads which adapters are loaded here.
            metric = GaugeMetricFamily(
                "pagedllm:lora_requests_info", "Running and waiting LoRA adapters.",
                labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            )  # fmt: skip
            metric.add_metric(
                [",".join(lora["running"]), ",".join(lora["waiting"]), str(lora["max_lora"])],
                time.time(),
            )
            yield metric


def _spec_decode_metrics(by_engine: dict, labels: list[str], values: dict):
    """vLLM's speculative decoding counters, acceptances by draft position labelled."""
    counters = {
        "spec_decode_num_drafts": "Verification rounds (a request's drafts in one step).",
        "spec_decode_num_draft_tokens": "Draft tokens verified.",
        "spec_decode_num_accepted_tokens": "Draft tokens accepted.",
    }
    for name, doc in counters.items():
        metric = CounterMetricFamily(f"pagedllm:{name}", doc, labels=labels)
        for rank, stats in by_engine.items():
            metric.add_metric(values[rank], float(stats[name]))
        yield metric
    metric = CounterMetricFamily(
        "pagedllm:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by their position in the draft (0: the first).",
        labels=[*labels, "position"],
    )
    for rank, stats in by_engine.items():
        for position, count in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"]):
            metric.add_metric([*values[rank], str(position)], float(count))
    yield metric


def spec_decode_line(previous: dict, stats: dict, seconds: float) -> str | None:
    """vLLM's speculative decoding log line over the interval, or None without drafts in it."""
    drafts = stats["spec_decode_num_drafts"] - previous["spec_decode_num_drafts"]
    if drafts <= 0:
        return None
    drafted = stats["spec_decode_num_draft_tokens"] - previous["spec_decode_num_draft_tokens"]
    accepted = (
        stats["spec_decode_num_accepted_tokens"] - previous["spec_decode_num_accepted_tokens"]
    )
    before = previous["spec_decode_num_accepted_tokens_per_pos"]
    per_pos = [
        (count - (before[i] if i < len(before) else 0)) / drafts
        for i, count in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"])
    ]
    return (
        f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, Accepted "
        f"throughput: {accepted / seconds:.2f} tokens/s, Drafted throughput: "
        f"{drafted / seconds:.2f} tokens/s, Accepted: {accepted} tokens, Drafted: {drafted} "
        f"tokens, Per-position acceptance rate: {', '.join(f'{r:.3f}' for r in per_pos)}, "
        f"Avg Draft acceptance rate: {100 * accepted / max(drafted, 1):.1f}%"
    )


class RequestMetrics:
    """Per-request histograms and token counters, fed by the outputs the server streams."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]

        def histogram(name: str, doc: str) -> Histogram:
            metric = Histogram(
                f"pagedllm:{name}", doc, labels, registry=registry, buckets=_LATENCY_BUCKETS
            )
            return metric.labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pagedllm:{name}", doc, labels, registry=registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first output token.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the request's end.")
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.")
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between two outputs of a running request."
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that ended.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.success = Counter(
            "pagedllm:request_success",
            "Requests that ended, by (first output's) finish reason.",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self.errors = Counter(
            "pagedllm:request_errors",
            "Requests answered with an error or cut short, by reason: rejected before they ran "
            "(bad_request, unauthorized, not_found, too_large, overloaded: the waiting queue is "
            "full, unavailable: the engine stopped), failed (internal, stream_error: after "
            "the stream began) or left by their client (client_disconnected).",
            ["model_name", "reason"],
            registry=registry,
        )
        self.model_name = model_name

    def count_error(self, reason: str) -> None:
        self.errors.labels(self.model_name, reason).inc()

    async def observe(
        self, gen: AsyncIterator[RequestOutput], delta: bool
    ) -> AsyncIterator[RequestOutput]:
        """Pass `gen`'s outputs through, recording the request's metrics when it ends."""
        generated = 0
        last = None
        try:
            async for output in gen:
                now = time.monotonic()
                if last is not None:
                    self.itl.observe(now - last)
                last = now
                if (delta or output.finished) and isinstance(output, RequestOutput):
                    generated += sum(len(c.token_ids) for c in output.outputs)
                if output.finished:
                    self._finished(output, generated)
                yield output
        finally:
            await gen.aclose()  # type: ignore[attr-defined] - aborts it if unfinished

    def _finished(self, output: RequestOutput, generated: int) -> None:
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(generated)
        reason = "stop"  # an embedding request's, once its prompt is pooled
        if isinstance(output, RequestOutput):
            reason = output.outputs[0].finish_reason if output.outputs else None
        self.success.labels(self.model_name, reason or "abort").inc()
        m = output.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.first_scheduled_time is not None:
            self.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.finished_time is not None:
            self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))


def stats_line(previous: dict, stats: dict, seconds: float) -> str:
    """vLLM's periodic log line: throughput since the last one, queue sizes, cache use."""
    prompt = (stats["num_prompt_tokens_total"] - previous["num_prompt_tokens_total"]) / seconds
    generation = (
        stats["num_generation_tokens_total"] - previous["num_generation_tokens_total"]
    ) / seconds
    queries = stats["prefix_cache_queries"]
    hit_rate = stats["prefix_cache_hits"] / queries if queries else 0.0
    return (
        f"Avg prompt throughput: {prompt:.1f} tokens/s, Avg generation throughput: "
        f"{generation:.1f} tokens/s, Running: {stats['num_running']} reqs, Waiting: "
        f"{stats['num_waiting']} reqs, Swapped: {stats['num_swapped']} reqs, KV cache usage: "
        f"{100 * stats['kv_cache_usage']:.1f}%, Prefix cache hit rate: {100 * hit_rate:.1f}%"
    )


async def log_stats(engine, interval: float) -> None:
    """Every `interval` seconds while there is work (or was since the last line), log it."""
    previous, then = engine.get_stats(), time.monotonic()
    while True:
        await asyncio.sleep(interval)
        stats, now = engine.get_stats(), time.monotonic()
        keys = ("num_prompt_tokens_total", "num_generation_tokens_total")
        busy = stats["num_running"] or stats["num_waiting"] or stats["num_swapped"]
        if busy or any(stats[k] != previous[k] for k in keys):
            logger.info("%s", stats_line(previous, stats, now - then))
            spec = "spec_decode_num_drafts" in stats and spec_decode_line(
                previous, stats, now - then
            )
            if spec:
                logger.info("%s", spec)
        previous, then = stats, now
