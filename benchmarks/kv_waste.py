"""`python -m benchmarks.kv_waste`: where KV memory goes under each allocation policy (the
PagedAttention paper's Figure 2).

After every step, each slot of KV memory a request holds is put in one of four classes:
- token states: slots holding a computed token's K and V;
- reserved: slots held for tokens the request will still compute;
- internal fragmentation: slots held that no token of the request will ever use (Max's and
  Pow2's over-reservation, and the unused tail of a paged request's last block);
- external fragmentation: free slots while the next waiting request cannot be admitted for lack
  of memory (for contiguous policies, no free extent is long enough; for paging, fewer free
  blocks than it needs). Free memory nobody is waiting for is not waste and is not counted.
The shares are over the sum of the four, summed over steps (slot-steps), as the paper reports
them: Max 20.4%, Pow2 26.8%, Oracle 38.2%, paged 96.3% token states (OPT-13B, ShareGPT).

How memory is used depends only on token counts, not on the model's numbers: with every
request generating exactly its output length (`ignore_eos`), the scheduler makes the same
decisions whatever the model computes. So this command runs the real scheduler and KV-cache
managers with a model that samples a fixed token, which takes seconds instead of hours, for
the paper's own geometry: OPT-13B's 800 KiB of KV per token in the ~12 GiB an A100-40GB has
left beside its 26 GB of weights (15,728 slots), max_model_len 2048, ShareGPT-shaped lengths
(means 161 prompt / 338 output tokens), all requests queued at once. `KVSlotBreakdown` itself
also observes real engines (`python -m benchmarks.load` reports it per run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field

from benchmarks import common
from pagedllm.bench.utils import table_lines
from pagedllm.bench.workload import (
    alpaca_like_workload,
    sharegpt_like_workload,
)
from pagedllm.config import KV_ALLOCATIONS, KV_ALLOCATORS, SchedulerConfig
from pagedllm.core.contiguous_kv_cache_manager import ContiguousKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.scheduler import Scheduler
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence

CLASSES = ("token_states", "reserved", "internal_fragmentation", "external_fragmentation")
# The paper's Figure 2 (OPT-13B, ShareGPT): share of KV memory holding token states. It gives no
# such figure for Alpaca.
PAPER_TOKEN_STATES = {"max": 0.204, "pow2": 0.268, "oracle": 0.382, "paged": 0.963}
OPT_13B_KV_BYTES_PER_TOKEN = 2 * 40 * 5120 * 2  # K and V, 40 layers, hidden 5120, fp16
PAPER_KV_CACHE_BYTES = 12 * 2**30


@dataclass
class KVSlotBreakdown:
    """Slot-steps of each class, summed over the steps observed."""

    slot_steps: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0.0))
    num_steps: int = 0

    def observe(self, scheduler: Scheduler, final_lens: dict[str, int], weight: float = 1.0):
        """Classify the KV memory after a step. `final_lens[request_id]`: prompt + output
        tokens the request ends with (its last sampled token never gets a KV slot)."""
        kv = scheduler.kv_cache_manager
        bs = kv.block_size
        counts = dict.fromkeys(CLASSES, 0)
        for group in scheduler.running:
            for seq in group.seqs:
                held = self._held_slots(kv, seq.seq_id)
                will_hold = final_lens[group.request_id] - 1
                tokens = seq.num_computed_tokens
                counts["token_states"] += tokens
                counts["reserved"] += max(0, min(held, will_hold) - tokens)
                counts["internal_fragmentation"] += held - max(tokens, min(held, will_hold))
        if scheduler.waiting and not self._head_fits(kv, scheduler):
            counts["external_fragmentation"] += kv.num_free_blocks * bs
        for name, count in counts.items():
            self.slot_steps[name] += weight * count
        self.num_steps += 1

    @staticmethod
    def _held_slots(kv, seq_id: str) -> int:
        if isinstance(kv, ContiguousKVCacheManager):
            return kv.regions[seq_id][1] * kv.block_size
        return len(kv.req_to_blocks[seq_id]) * kv.block_size

    @staticmethod
    def _head_fits(kv, scheduler: Scheduler) -> bool:
        head = scheduler.waiting[0].first
        if isinstance(kv, ContiguousKVCacheManager):
            return kv.fits(head)
        first_chunk = min(head.num_tokens, scheduler.config.max_num_batched_tokens)
        return kv.num_free_blocks >= -(-first_chunk // kv.block_size)

    def shares(self) -> dict[str, float]:
        total = sum(self.slot_steps.values())
        return {name: (v / total if total else 0.0) for name, v in self.slot_steps.items()}

    def to_dict(self) -> dict:
        return {"shares": self.shares(), "slot_steps": dict(self.slot_steps),
                "num_steps": self.num_steps}  # fmt: skip


def make_kv_cache_manager(
    policy: str, num_blocks: int, block_size: int, max_model_len: int, allocator: str = "buddy"
):
    """The policy's KV-cache manager (paged: prefix caching off, as in the paper)."""
    if policy == "paged":
        return KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    return ContiguousKVCacheManager(num_blocks, block_size, policy, max_model_len, allocator)


def simulate(
    policy: str,
    workload: list[tuple[list[int], int]],
    *,
    num_slots: int,
    block_size: int = 16,
    max_model_len: int = 2048,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    allocator: str = "buddy",
) -> dict:
    """Run `workload` (all queued at once) through the real scheduler with a model that samples
    token 0; returns the breakdown, steps and the mean number of running requests."""
    kv = make_kv_cache_manager(
        policy, num_slots // block_size, block_size, max_model_len, allocator
    )
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len)
    scheduler = Scheduler(config, kv)
    final_lens = {}
    for i, (prompt, output_len) in enumerate(workload):
        params = SamplingParams(max_tokens=output_len, ignore_eos=True)
        request = Sequence.of(str(i), prompt, params, eos_token_ids=[], arrival_time=float(i))
        scheduler.add_request(request)
        final_lens[request.request_id] = len(prompt) + output_len
    breakdown = KVSlotBreakdown()
    batched = peak = steps = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        sampled = {r.seq_id: [0] for r in out.scheduled_requests if out.needs_sample(r)}
        scheduler.update_from_output(out, ModelRunnerOutput(sampled))
        breakdown.observe(scheduler, final_lens)
        running = len(out.scheduled_requests)
        batched, peak, steps = batched + running, max(peak, running), steps + 1
    kv.check_integrity()
    assert kv.num_free_blocks == num_slots // block_size, "blocks leaked"
    return {
        "policy": policy,
        "breakdown": breakdown.to_dict(),
        "num_steps": steps,
        "mean_batched_requests": batched / steps,
        "max_batched_requests": peak,
        "num_preemptions": scheduler.num_preemptions_total,
    }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("benchmark")
    group.add_argument("--policies", default="max,pow2,oracle,paged",
                       help="comma-separated (default: max,pow2,oracle,paged)")  # fmt: skip
    group.add_argument("--workload", choices=("sharegpt", "alpaca"), default="sharegpt")
    group.add_argument("--num-prompts", type=int, default=1000, help="requests (default: 1000)")
    group.add_argument("--scale", type=float, default=1.0,
                       help="length scale (default: 1, the real lengths)")  # fmt: skip
    group.add_argument("--workload-seed", type=int, default=0)
    group.add_argument("--num-kv-slots", type=int,
                       default=PAPER_KV_CACHE_BYTES // OPT_13B_KV_BYTES_PER_TOKEN,
                       help="KV pool size in tokens (default: 15728, OPT-13B's 800 KiB per "
                       "token in 12 GiB)")  # fmt: skip
    group.add_argument("--block-size", type=int, default=16, help="paged block size (default: 16)")
    group.add_argument("--max-model-len", type=int, default=2048, help="(default: 2048, OPT's)")
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--allocator", choices=KV_ALLOCATORS, default="buddy",
                       help="how contiguous regions are placed (default: buddy, as the paper's "
                       "Orca baselines)")  # fmt: skip
    group.add_argument("--plot", default=None, help="write the figure to this PNG")
    group.add_argument("--output-json", default=None, help="write every figure here")


def run(ns: argparse.Namespace) -> dict:
    policies = [p.strip() for p in ns.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in KV_ALLOCATIONS]
    if bad:
        raise ValueError(f"unknown policy {bad[0]!r}: choose from {', '.join(KV_ALLOCATIONS)}")
    make = sharegpt_like_workload if ns.workload == "sharegpt" else alpaca_like_workload
    workload = make(ns.num_prompts, 50272, scale=ns.scale, seed=ns.workload_seed,
                    max_model_len=ns.max_model_len)  # fmt: skip
    rows = []
    for policy in policies:
        # Contiguous regions are exact to the token (block size 1), as the paper's baselines.
        block_size = ns.block_size if policy == "paged" else 1
        start = time.perf_counter()
        row = simulate(
            policy, workload, num_slots=ns.num_kv_slots, block_size=block_size,
            max_model_len=ns.max_model_len, max_num_seqs=ns.max_num_seqs,
            max_num_batched_tokens=ns.max_num_batched_tokens, allocator=ns.allocator,
        )  # fmt: skip
        row["block_size"] = block_size
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
    return {
        "workload": ns.workload, "num_prompts": ns.num_prompts, "scale": ns.scale,
        "workload_seed": ns.workload_seed, "allocator": ns.allocator,
        "num_kv_slots": ns.num_kv_slots, "max_model_len": ns.max_model_len,
        "mean_prompt_len": _mean(len(p) for p, _ in workload),
        "mean_output_len": _mean(o for _, o in workload), "rows": rows,
    }  # fmt: skip


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def format_table(result: dict) -> str:
    header = ["policy", "block", "token states", "reserved", "internal frag.", "external frag.",
              "paper: token states", "mean batch", "steps"]  # fmt: skip
    body = []
    for row in result["rows"]:
        shares = row["breakdown"]["shares"]
        paper = PAPER_TOKEN_STATES.get(row["policy"]) if result["workload"] == "sharegpt" else None
        body.append([
            row["policy"], str(row["block_size"]),
            *(f"{100 * shares[name]:.1f}%" for name in CLASSES),
            f"{100 * paper:.1f}%" if paper else "-",
            f"{row['mean_batched_requests']:.1f}", str(row["num_steps"]),
        ])  # fmt: skip
    title = (
        f"{result['num_prompts']} {result['workload']}-like requests (mean prompt "
        f"{result['mean_prompt_len']:.0f}, output {result['mean_output_len']:.0f} tokens), "
        f"KV pool {result['num_kv_slots']} slots, max_model_len {result['max_model_len']}, "
        f"contiguous regions placed by {result['allocator']}"
    )
    return "\n".join([title, *table_lines([header, *body])])


def plot(result: dict, path: str) -> None:
    """Stacked bars of the four classes per policy, like the paper's Figure 2."""
    from benchmarks.plots import pyplot

    plt = pyplot()
    rows = result["rows"]
    names = [r["policy"] for r in rows]
    colors = {"token_states": "#4c72b0", "reserved": "#dd8452",
              "internal_fragmentation": "#c44e52", "external_fragmentation": "#8c8c8c"}  # fmt: skip
    fig, ax = plt.subplots(figsize=(6, 4))
    bottom = [0.0] * len(rows)
    for name in CLASSES:
        values = [100 * r["breakdown"]["shares"][name] for r in rows]
        ax.bar(names, values, bottom=bottom, color=colors[name],
               label=name.replace("_", " "))  # fmt: skip
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for i, r in enumerate(rows):
        share = 100 * r["breakdown"]["shares"]["token_states"]
        ax.text(i, share / 2, f"{share:.1f}%", ha="center", va="center", color="white")
    ax.set_ylabel("KV memory (% of slot-steps)")
    ax.set_ylim(0, 100)
    ax.set_title(f"KV memory use, {result['workload']}-like, {result['num_kv_slots']} slots")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(ns: argparse.Namespace) -> int:
    result = run(ns)
    print(format_table(result))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=1)
    if ns.plot:
        plot(result, ns.plot)
        print(f"figure: {ns.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(common.run(add_cli_args, main, engine=False))
