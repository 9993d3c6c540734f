#!/usr/bin/env bash
# One GPU session's checks and figures, in the order they matter: correctness first, then the
# kernel and step profiles, then W1. Each stage writes its log to $OUT (default ./gpu-out) and the
# script goes on after a failing stage, so one call brings back everything it could run.
# The peer stage reads ../shared/peers/ from a copy in .peers/ (git-excluded; the device tool's
# `carry`), since only the repository travels to the GPU machine.
#
#   bench/gpu_run.sh tests profile w1        # stages: tests kernels attention profile w1 w1-split peer tp
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
echo "commit $commit, $(date -u +%FT%TZ)" | tee "$OUT/summary.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/summary.txt"

stage() {
    local name=$1
    shift
    local t0=$SECONDS
    echo "== $name: $*" | tee -a "$OUT/summary.txt"
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "   rc=$rc in $((SECONDS - t0)) s; last lines:" | tee -a "$OUT/summary.txt"
    tail -n "${TAIL:-8}" "$OUT/$name.log" | sed 's/^/   /' | tee -a "$OUT/summary.txt"
}

for what in "$@"; do
    case $what in
    tests) stage tests "$PY" -m pytest -q -x -m gpu tests/test_triton_ops.py tests/test_gpu_engine.py ;;
    kernels) stage kernels "$PY" -m pytest -q -x tests/test_triton_kernels.py ;;
    attention) stage attention "$PY" bench/attention.py ;;
    profile) TAIL=40 stage profile "$PY" bench/profile_step.py --steps 16 ;;
    w1) TAIL=12 stage w1 "$PY" bench/throughput.py --workload w1 --device cuda --mode in-process ;;
    w1-off) TAIL=12 stage w1-off "$PY" bench/throughput.py --workload w1 --device cuda --mode in-process --fused-ops off ;;
    w1-split) TAIL=12 stage w1-split "$PY" bench/throughput.py --workload w1 --device cuda ;;
    peer) TAIL=12 stage peer "$PY" bench/throughput.py --workload w1 --device cuda --mode in-process --peer "${PEER:-.peers/hf_continuous_batching.py}" ;;
    tp) stage tp "$PY" -m pytest -q -x tests/test_tensor_parallel.py -k gpu ;;
    *) echo "unknown stage $what" | tee -a "$OUT/summary.txt" ;;
    esac
done
