"""matplotlib for the benchmark figures, imported only when a figure is asked for (inside the
functions: pagedllm itself does not need it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

POLICY_STYLE = {  # the paper's order and names
    "paged": ("pagedllm (paged)", "C3", "o"),
    "oracle": ("Orca (Oracle)", "C0", "s"),
    "pow2": ("Orca (Pow2)", "C1", "^"),
    "max": ("Orca (Max)", "C2", "v"),
}


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("figures need matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _policies(runs: list[dict[str, Any]]) -> list[str]:
    seen = list(dict.fromkeys(r["policy"] for r in runs))
    return [p for p in POLICY_STYLE if p in seen] + [p for p in seen if p not in POLICY_STYLE]


def plot_load(result: dict[str, Any], path: Path | str, latency_cap: float = 1.0) -> None:
    """Top row: mean normalized latency vs request rate, a line per policy, a panel per workload
    (the y axis stops at `latency_cap`, as the paper's do: past the knee latency explodes).
    Bottom row: mean batched requests per policy at each rate (bars)."""
    plt = pyplot()
    runs = result["runs"]
    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    policies = _policies(runs)
    fig, axes = plt.subplots(2, len(workloads), figsize=(5.5 * len(workloads), 7.5), squeeze=False)
    for col, shape in enumerate(workloads):
        mine = [r for r in runs if r["workload"] == shape]
        rates = sorted({r["request_rate"] for r in mine})
        ax = axes[0][col]
        for policy in policies:
            points = sorted(
                (r["request_rate"], r["mean_normalized_latency_s"])
                for r in mine
                if r["policy"] == policy
            )
            if not points:
                continue
            label, color, marker = POLICY_STYLE.get(policy, (policy, None, "x"))
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, label=label, color=color, marker=marker)
        top = max((r["mean_normalized_latency_s"] for r in mine), default=latency_cap)
        ax.set_ylim(0, min(latency_cap, top * 1.05) or latency_cap)
        ax.set_title(f"{shape}: latency")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("normalized latency (s/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")

        ax = axes[1][col]
        width = 0.8 / max(1, len(policies))
        for k, policy in enumerate(policies):
            by_rate = {r["request_rate"]: r["mean_batched_requests"] for r in mine
                       if r["policy"] == policy}  # fmt: skip
            label, color, _ = POLICY_STYLE.get(policy, (policy, None, "x"))
            xs = [i + (k - (len(policies) - 1) / 2) * width for i in range(len(rates))]
            ax.bar(xs, [by_rate.get(rate, 0.0) for rate in rates], width, label=label,
                   color=color)  # fmt: skip
        ax.set_xticks(range(len(rates)), [f"{rate:g}" for rate in rates])
        top = max((r["mean_batched_requests"] for r in mine), default=1.0)
        ax.set_ylim(0, 1.3 * top or 1.0)  # room for the legend above the bars
        ax.set_title(f"{shape}: mean batched requests")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("# batched requests")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize="small", ncols=2, loc="upper left")
    _finish(fig, result, path)


def plot_block_size(result: dict[str, Any], path: Path | str) -> None:
    """Mean normalized latency of the paged engine vs block size, a bar group per block size
    and a bar per workload (the paper's Fig. 18a)."""
    plt = pyplot()
    runs = result["runs"]
    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    sizes = sorted({r["block_size"] for r in runs})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(workloads))
    for k, shape in enumerate(workloads):
        by_size = {r["block_size"]: r for r in runs if r["workload"] == shape}
        xs = [i + (k - (len(workloads) - 1) / 2) * width for i in range(len(sizes))]
        rate = next(iter(by_size.values()))["request_rate"]
        ax.bar(
            xs,
            [by_size[s]["mean_normalized_latency_s"] if s in by_size else 0.0 for s in sizes],
            width,
            label=f"{shape} ({rate:g} req/s)",
        )
    ax.set_xticks(range(len(sizes)), [str(s) for s in sizes])
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize="small")
    _finish(fig, result, path)


def _finish(fig, result: dict[str, Any], path: Path | str) -> None:
    engine = result.get("engine", {})
    if engine:
        slots = engine.get("kv_pool_token_slots")
        mib = (engine.get("kv_cache_memory_bytes") or 0) / 2**20
        pool = f"{slots} slots" if slots else f"{mib:.0f} MiB"
        fig.suptitle(
            f"{engine.get('model')} on {engine.get('device')}, KV pool of {pool}",
            fontsize="medium",
        )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
