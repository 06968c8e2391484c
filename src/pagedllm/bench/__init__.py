"""`pagedllm bench throughput | latency | serve`: the benchmarks that ship with the package.

The experiments behind docs/benchmarks.md (prefix caching, preemption, load, peers...) live in
the checkout's top-level `benchmarks/` tree, as `python -m benchmarks.<name>`; they build on
`utils` (timing, CPU counters, figures, tables, reports), `workload` and `roofline` here.
"""
