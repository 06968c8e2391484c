#!/bin/bash
# Data parallelism behind one server (docs/distributed.md): `pagedllm bench serve` at
# concurrency 32 against `pagedllm serve` with one engine replica (all cores) and with
# --data-parallel-size 2 (each replica its share of the cores), the same workload.
#   benchmarks/data_parallel.sh [extra serve flags]
set -euo pipefail
PY=${PY:-.venv/bin/python}
CLI=("$PY" -m pagedllm.entrypoints.cli)
PORT=${PORT:-8311}
lscpu | grep -E "Model name|^CPU\(s\)" || true
for dp in 1 2; do
    echo "== --data-parallel-size $dp"
    "${CLI[@]}" serve --port $PORT --max-model-len 1024 --kv-cache-memory 512MiB \
        --disable-log-stats --data-parallel-size $dp "$@" >/tmp/pagedllm-dp$dp.log 2>&1 &
    server=$!
    until curl -sf http://127.0.0.1:$PORT/health >/dev/null; do
        kill -0 $server || { cat /tmp/pagedllm-dp$dp.log; exit 1; }
        sleep 0.5
    done
    "${CLI[@]}" bench serve --base-url http://127.0.0.1:$PORT --num-prompts 192 \
        --max-concurrency 32 --request-rate inf 2>&1 | grep -vE "^\s*$"
    kill -TERM $server; wait $server || true
done
