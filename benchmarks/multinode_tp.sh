#!/bin/bash
# Tensor parallelism across two "hosts" on this machine (docs/distributed.md): the same
# `pagedllm bench throughput` workload on one rank (all cores, then one core), TP=2 on one host
# (a rank per core) and TP=2 over a veth link between two network namespaces (each host one
# core), with the bytes that crossed the link. Needs root and iproute2. Run from the checkout:
#   sudo benchmarks/multinode_tp.sh [extra bench flags]
set -euo pipefail
PY=${PY:-.venv/bin/python}
BENCH=("$PY" -m pagedllm.entrypoints.cli bench throughput --num-prompts 32 --scale 0.25
       --max-model-len 1024 --kv-cache-memory 512MiB "$@")
NS=pdlbench-h1 A=pdlbencha B=pdlbenchb PORT=29611
cleanup() { ip link del $A 2>/dev/null || true; ip netns del $NS 2>/dev/null || true; }
trap cleanup EXIT
cleanup
lscpu | grep -E "Model name|^CPU\(s\)" || true

run() { echo "== $1"; shift; "$@" 2>&1 | grep -E "^\[pagedllm\]|tokens/s" | grep -v "^\[pagedllm\] prompts"; }
run "one rank, 2 cores" "${BENCH[@]}"
run "one rank, 1 core" taskset -c 0 "${BENCH[@]}"
run "TP=2, one host (a core per rank)" "${BENCH[@]}" -tp 2

ip netns add $NS
ip link add $A type veth peer name $B
ip link set $B netns $NS
ip addr add 10.231.18.1/30 dev $A
ip -n $NS addr add 10.231.18.2/30 dev $B
ip link set $A up; ip -n $NS link set $B up; ip -n $NS link set lo up
FLAGS=(-tp 2 --nnodes 2 --master-addr 10.231.18.1 --master-port $PORT)
before=$(cat /sys/class/net/$A/statistics/tx_bytes)
ip netns exec $NS taskset -c 1 env GLOO_SOCKET_IFNAME=$B "${BENCH[@]}" "${FLAGS[@]}" \
    --node-rank 1 >/dev/null 2>&1 &
run "TP=2, two hosts over veth (a core each)" taskset -c 0 env GLOO_SOCKET_IFNAME=$A \
    "${BENCH[@]}" "${FLAGS[@]}" --node-rank 0
wait
after=$(cat /sys/class/net/$A/statistics/tx_bytes)
echo "host 0 sent $(( (after - before) / 1024 )) KiB over the link (start-up included)"
