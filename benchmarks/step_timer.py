"""Timing the parts of an engine step (benchmarks.step): which of the engine's public methods a
step's time went to, and the mean and share of each part over many steps."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from pagedllm.bench.utils import table_lines

# Parts of a step, in table order; they sum to the step time.
PARTS = (
    "schedule",
    "prepare_inputs",
    "forward",
    "logits_and_sampling",
    "update_and_outputs",
    "other_in_execute_model",
)


class StepTimer:
    """While open (a context manager), each `step()` returns the seconds spent in every part of
    one engine step, and what the step's batch was made of. It wraps public methods on the
    engine's own instances (never their classes) and puts the originals back on closing."""

    def __init__(self, engine) -> None:
        import torch

        self.engine = engine
        cuda = engine.device.type == "cuda"
        # On a GPU the kernels run asynchronously: synchronize so each part owns its time.
        self._sync = (lambda: torch.cuda.synchronize(engine.device)) if cuda else (lambda: None)
        self._acc: dict[str, float] | None = None  # the current step's seconds per wrapped call
        self._batch: dict[str, float] = {}
        self._wrapped: list[tuple[object, str]] = []

    def __enter__(self) -> StepTimer:
        runner = self.engine.executor.driver_worker.model_runner
        self._wrap(self.engine.scheduler, "schedule", "schedule", self._record_batch)
        self._wrap(runner, "execute_model", "execute_model")
        self._wrap(runner, "prepare_inputs", "prepare_inputs")  # host arrays
        self._wrap(runner, "execute", "execute")  # their tensors, the forward and the logits
        self._wrap(runner.model, "forward", "forward")  # nn.Module.__call__ finds it
        self._wrap(runner.model, "compute_logits", "compute_logits")
        self._wrap(runner, "sample", "sample")
        return self

    def __exit__(self, *exc) -> None:
        # The wrappers are instance attributes shadowing the class's methods: deleting them
        # leaves the instances as they were.
        for obj, name in reversed(self._wrapped):
            delattr(obj, name)
        self._wrapped.clear()

    def _wrap(self, obj, name: str, key: str, after=None) -> None:
        if name in vars(obj):
            raise RuntimeError(f"{type(obj).__name__}.{name} is already wrapped")
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            self._sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self._sync()
            if self._acc is not None:
                self._acc[key] += time.perf_counter() - t0
            if after is not None:
                after(out)
            return out

        setattr(obj, name, timed)
        self._wrapped.append((obj, name))

    def _record_batch(self, so) -> None:
        """Tokens, sequences, prefills and the context the step's tokens attend to, read from
        the SchedulerOutput before the step advances the requests."""
        tokens = context = prefills = 0
        for r in so.scheduled_requests:
            n = so.num_scheduled_tokens[r.seq_id]
            tokens += n
            # Its n tokens attend to computed+1 ... computed+n tokens (themselves included).
            context += n * r.num_computed_tokens + n * (n + 1) / 2
            prefills += r.num_computed_tokens < r.num_prompt_tokens
        self._batch = {"num_seqs": len(so.scheduled_requests), "num_tokens": tokens,
                       "num_prefill_seqs": prefills, "context_token_sum": context}  # fmt: skip

    def step(self) -> tuple[list, dict[str, float]]:
        """One engine.step(): its outputs, and a record of seconds per part (summing to step_s)
        plus the batch's make-up."""
        self._acc = defaultdict(float)
        self._batch = {}
        t0 = time.perf_counter()
        outputs = self.engine.step()
        self._sync()
        step_s = time.perf_counter() - t0
        a, self._acc = self._acc, None
        # execute's own work besides the model: block moves, the step's tensors and attention
        # metadata, gathering the rows to sample: input preparation on the device side.
        in_execute = a["execute"] - a["forward"] - a["compute_logits"]
        record = {
            "step_s": step_s,
            "schedule": a["schedule"],
            "prepare_inputs": a["prepare_inputs"] + in_execute,
            "forward": a["forward"],
            "logits_and_sampling": a["compute_logits"] + a["sample"],
            "compute_logits": a["compute_logits"],
            "sample": a["sample"],
            # The rest of LLMEngine.step: update_from_output, detokenizing, building outputs.
            "update_and_outputs": step_s - a["schedule"] - a["execute_model"],
            # execute_model's own work around its three calls (a call's overhead, in practice).
            "other_in_execute_model": a["execute_model"]
            - a["prepare_inputs"]
            - a["execute"]
            - a["sample"],
            **self._batch,
        }
        return outputs, record


def breakdown(records: list[dict[str, float]]) -> dict[str, Any]:
    """Mean ms per step of each part and its share of the step, over `records`."""
    total = sum(r["step_s"] for r in records)
    n = len(records)
    parts = {}
    for key in (*PARTS, "compute_logits", "sample"):
        s = sum(r[key] for r in records)
        parts[key] = {"ms_per_step": 1e3 * s / n, "share": s / total if total else 0.0}
    # The model's own work: the decoder's forward and the LM head's logits.
    model_s = sum(r["forward"] + r["compute_logits"] for r in records)
    return {
        "num_steps": n,
        "step_ms": 1e3 * total / n,
        "parts": parts,
        "outside_forward_share": 1 - model_s / total if total else 0.0,
    }


def breakdown_table(b: dict[str, Any]) -> str:
    rows = [("part", "ms/step", "share")]
    for key in PARTS:
        p = b["parts"][key]
        rows.append((key, f"{p['ms_per_step']:.2f}", f"{p['share']:.1%}"))
        if key == "logits_and_sampling":
            for sub in ("compute_logits", "sample"):
                q = b["parts"][sub]
                rows.append((f"  of which {sub}", f"{q['ms_per_step']:.2f}", f"{q['share']:.1%}"))
    rows.append(("step", f"{b['step_ms']:.2f}", "100.0%"))
    return "\n".join(table_lines(rows))
