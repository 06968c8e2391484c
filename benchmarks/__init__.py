"""The experiments behind docs/benchmarks.md and docs/performance.md, run from the checkout's
root as `python -m benchmarks.<name> [flags]` (every engine flag of `pagedllm`, plus their own;
`--help` lists them). Shared pieces: common.py here, and pagedllm.bench (utils, workload,
roofline) in the package."""
