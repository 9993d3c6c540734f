#!/usr/bin/env bash
# One GPU session's checks and figures, in the order they matter: correctness first, then the
# kernel and step profiles, then W1. Each stage writes its log to $OUT (default ./gpu-out) and the
# script goes on after a failing stage, so one call brings back everything it could run.
# The peer stage reads ../shared/peers/ from a copy in .peers/ (git-excluded; the device tool's
# `carry`), since only the repository travels to the GPU machine.
#
#   bench/gpu_run.sh tests profile w1        # stages: see the case below
#
# Multi-GPU stages (tp-*) need a machine with 2 GPUs. NVLink multicast stays off (the device
# machines' rule; the TP ranks inherit this environment).
# Wheels the GPU machine lacks (grpcio >= the stubs' version, health checking, reflection) are
# installed from .whl/ when the call carries that git-excluded folder.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
# The device tool's copy of the working tree can carry an older .git than the tree it copies: pass
# COMMIT=<the local HEAD> for the label the logs carry.
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
echo "commit $commit, $(date -u +%FT%TZ)" | tee -a "$OUT/summary.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/summary.txt"

stage() {
    local name=$1
    shift
    local t0=$SECONDS
    echo "== $name: $*" | tee -a "$OUT/summary.txt"
    timeout "${STAGE_TIMEOUT:-300}" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "   rc=$rc in $((SECONDS - t0)) s; last lines:" | tee -a "$OUT/summary.txt"
    tail -n "${TAIL:-8}" "$OUT/$name.log" | sed 's/^/   /' | tee -a "$OUT/summary.txt"
}

# Tensor-parallel stages: NCCL's start-up log, and every process's stacks each 60 s (a hang shows
# where it waits before the stage's time limit).
tp_debug() {
    NCCL_DEBUG=${NCCL_DEBUG:-INFO} NCCL_DEBUG_SUBSYS=${NCCL_DEBUG_SUBSYS:-INIT} TANDEM_STACK_DUMP_S=60 \
        PYTHONPATH=$PWD/bench/hangdump${PYTHONPATH:+:$PYTHONPATH} "$@"
}

# W1 fp8 under named flag sets, each PRESETS entry in turn, ROUNDS times (default 1):
#   today: as today; mma: FP8_MMA (64-key tiles, 2 stages); vt: the tiled V store from 512 tokens a
#   launch; bs64: 64-token blocks; tma: the decode tiles through TMA (TMA_KV, blocks of 64 or more;
#   alone, the widening loop's in 64-key tiles); full: FULL_TILES (with tma, the last tile by pointer
#   loads); cap: at most 80 registers (six programs an SM; the widening loop at 2 stages); joined
#   with "+" (mma+tma+full+vt+bs64). Each run counts the kernel variants
#   compiled in its timed window (a config's first run on a machine can pay for them).
w1_presets() {
    local i preset flags
    for i in $(seq "${ROUNDS:-1}"); do
        for preset in ${PRESETS:-mma+vt today}; do
            flags=()
            local keys=()
            [[ +$preset+ == *+mma+* ]] && keys+=('"FP8_MMA": true' '"BLOCK_N": 64' '"num_stages": 2')
            [[ +$preset+ == *+tma+* ]] && keys+=('"TMA_KV": true')
            [[ +$preset+ == *+tma+* && +$preset+ != *+mma+* ]] && keys+=('"BLOCK_N": 64')  # the widening loop's
            [[ +$preset+ == *+full+* ]] && keys+=('"FULL_TILES": true')
            [[ +$preset+ == *+cap+* ]] && keys+=('"maxnreg": 80')
            [[ +$preset+ == *+cap+* && +$preset+ != *+mma+* ]] && keys+=('"num_stages": 2')  # (the widening loop's)
            if ((${#keys[@]})); then
                local IFS=,
                flags+=(--decode-config "{${keys[*]}}")
                unset IFS
            fi
            [[ +$preset+ == *+vt+* ]] && flags+=(--v-tile-min-tokens 512)
            [[ +$preset+ == *+bs64+* ]] && flags+=(--block-size 64)
            echo "W1 fp8 $preset: ${flags[*]}"
            "$PY" bench/throughput.py --workload "${WORKLOAD:-w1}" --device cuda --mode in-process --kv-cache-dtype fp8 --trace-compiles "${flags[@]}" | grep "output tok/s\|device:\|first launched in the timed run"
        done
    done
}
export -f w1_presets
export PY

run() {
    case $1 in
    tests) stage tests "$PY" -m pytest -q tests/test_triton_ops.py tests/test_sampling_kernel.py tests/test_gpu_engine.py ;;
    # Every GPU test of the engine, the sampler and the fp8 GEMM (issue 18's request features with the fused sampler among them).
    gpu-tests) TAIL=30 STAGE_TIMEOUT=${STAGE_TIMEOUT:-400} stage gpu-tests "$PY" -m pytest -q -m gpu tests/test_gpu_engine.py tests/test_sampling_kernel.py tests/test_fp8_gemm.py tests/test_triton_ops.py ;;
    moe-tests) TAIL=20 stage moe-tests "$PY" -m pytest -q -m gpu tests/test_fused_moe.py tests/test_triton_ops.py tests/test_gpu_engine.py -k "moe or rope or famil" ;;
    moe) TAIL=30 stage moe "$PY" bench/moe.py ;;
    route-sweep) TAIL=30 stage route-sweep "$PY" bench/moe.py --sweep-route --num-tokens ${SWEEP_TOKENS:-8 64 256 1024 8192} ;;
    moe-sweep) TAIL=60 stage moe-sweep "$PY" bench/moe.py --sweep --num-tokens ${SWEEP_TOKENS:-64 128 256 16 512 2048 8192} ;;
    # W3 in three calls (each well under the device tool's 10 minutes): the 61 GB checkpoint into
    # /dev/shm (it stays while the machine is held), then each mode.
    w3-build) stage w3-build "$PY" bench/random_checkpoint.py --shape qwen3-30b-a3b --out "${W3_DIR:-/dev/shm/tandem-w1-qwen3-30b-a3b}" ;;
    w3) TAIL=12 STAGE_TIMEOUT=580 stage w3 "$PY" bench/throughput.py --workload w3 --device cuda --mode in-process --w1-dir "${W3_DIR:-/dev/shm/tandem-w1-qwen3-30b-a3b}" ;;
    w3-trace) TAIL=30 STAGE_TIMEOUT=580 stage w3-trace "$PY" bench/throughput.py --workload w3 --device cuda --mode in-process --trace-compiles --w1-dir "${W3_DIR:-/dev/shm/tandem-w1-qwen3-30b-a3b}" ;;
    w3-profile) TAIL=40 stage w3-profile "$PY" bench/profile_step.py --model "${W3_DIR:-/dev/shm/tandem-w1-qwen3-30b-a3b}" --fused-ops on --steps 16 ;;
    w3-split) TAIL=12 STAGE_TIMEOUT=580 stage w3-split "$PY" bench/throughput.py --workload w3 --device cuda --mode split --w1-dir "${W3_DIR:-/dev/shm/tandem-w1-qwen3-30b-a3b}" ;;
    llama-1b) TAIL=12 stage llama-1b "$PY" bench/throughput.py --workload w1 --shape llama-3.2-1b --device cuda --mode in-process ;;
    kernels) stage kernels "$PY" -m pytest -q -x tests/test_triton_kernels.py ;;
    attention) stage attention "$PY" bench/attention.py ;;
    # What a prompt arriving costs the running decodes (the mixed step against the decode step).
    mixed) TAIL=14 stage mixed "$PY" bench/mixed_step.py --batch 16 64 --prompt-len 128 512 1024 2048 ;;
    profile) TAIL=40 stage profile "$PY" bench/profile_step.py --steps 16 ;;
    w1) TAIL=12 stage w1 "$PY" bench/throughput.py --workload w1 --device cuda --mode in-process ;;
    w1-trace) TAIL=40 stage w1-trace "$PY" bench/throughput.py --workload w1 --device cuda --mode in-process --trace-compiles ;;
    w1-off) TAIL=12 stage w1-off "$PY" bench/throughput.py --workload w1 --device cuda --mode in-process --fused-ops off ;;
    w1-one) TAIL=12 stage w1-one "$PY" bench/throughput.py --workload w1 --device cuda --max-plans-in-flight 1 ;;
    w1-split) TAIL=12 stage w1-split "$PY" bench/throughput.py --workload w1 --device cuda ;;
    # Issue 16's target: every token streamed, the scheduler split into its engine core and API servers.
    w1-split1) TAIL=12 stage w1-split1 "$PY" bench/throughput.py --workload w1 --device cuda --stream-interval 1 ;;
    # The same with two plans in flight (the scheduler service's default is three; in-process keeps two).
    w1-split1-2) TAIL=14 stage w1-split1-2 "$PY" bench/throughput.py --workload w1 --device cuda --stream-interval 1 --max-plans-in-flight 2 ;;
    w1-split1-one) TAIL=12 stage w1-split1-one "$PY" bench/throughput.py --workload w1 --device cuda --mode split --stream-interval 1 --api-server-count 0 ;;
    # BENCH.md W2 (issue 16): Poisson arrivals, every token streamed, 4 client processes; the JSON beside the log.
    w2) TAIL=30 STAGE_TIMEOUT=580 stage w2 "$PY" bench/serve.py --workload w2 --device cuda --request-rate 8 24 48 --num-processes 4 --json "$OUT/w2.json" ;;
    w2-prefix) TAIL=30 STAGE_TIMEOUT=580 stage w2-prefix "$PY" bench/serve.py --workload w2 --device cuda --request-rate 24 --shared-prefix ${SHARED_PREFIX:-1000} --num-processes 4 --json "$OUT/w2-prefix.json" ;;
    # The prefill budget while decoding (issue 16 item 2), to choose its default: W2's ITL and W1 with PREFILL_BUDGET.
    w2-budget) TAIL=30 STAGE_TIMEOUT=580 stage w2-budget "$PY" bench/serve.py --workload w2 --device cuda --request-rate 8 24 48 --num-processes 4 --max-prefill-tokens-while-decoding ${PREFILL_BUDGET:-512} --json "$OUT/w2-budget.json" ;;
    w1-budget) TAIL=12 stage w1-budget "$PY" bench/throughput.py --workload w1 --device cuda --mode in-process --max-prefill-tokens-while-decoding ${PREFILL_BUDGET:-512} ;;
    peer) TAIL=12 stage peer "$PY" bench/throughput.py --workload w1 --device cuda --mode in-process --peer "${PEER:-.peers/hf_continuous_batching.py}" ;;
    tp-smoke) TAIL=30 tp_debug stage tp-smoke "$PY" bench/tp_smoke.py ;;
    tp-tests) TAIL=30 tp_debug stage tp-tests "$PY" -m pytest -q -x -s -m gpu tests/test_tensor_parallel.py ;;
    tp-w1) TAIL=12 tp_debug stage tp-w1 "$PY" bench/throughput.py --workload w1 --device cuda -tp 2 ;;
    8b-tp1) TAIL=12 stage 8b-tp1 "$PY" bench/throughput.py --workload w1 --shape qwen3-8b --device cuda --mode in-process -tp 1 ;;
    8b-tp2) TAIL=12 tp_debug stage 8b-tp2 "$PY" bench/throughput.py --workload w1 --shape qwen3-8b --device cuda --mode in-process -tp 2 ;;
    tp-profile) TAIL=40 tp_debug stage tp-profile "$PY" bench/profile_step.py --shape qwen3-8b -tp 2 --fused-ops on --steps 16 ;;
    tp-broadcast) stage tp-broadcast "$PY" bench/tp_broadcast.py --tp 2 ;;
    # Issue 19 (several GPUs): correctness at TP=2 (MoE, FP8 included), then its figures.
    tp-gpu-tests) TAIL=30 tp_debug stage tp-gpu-tests "$PY" -m pytest -q -m gpu tests/test_tensor_parallel.py ;;
    tp-w1-split1) TAIL=12 tp_debug stage tp-w1-split1 "$PY" bench/throughput.py --workload w1 --device cuda -tp 2 --stream-interval 1 ;;
    w3-tp2) TAIL=12 STAGE_TIMEOUT=580 tp_debug stage w3-tp2 "$PY" bench/throughput.py --workload w3 --device cuda -tp 2 --w1-dir "${W3_DIR:-/dev/shm/tandem-w1-qwen3-30b-a3b}" ;;
    w4-tp2) TAIL=12 STAGE_TIMEOUT=580 tp_debug stage w4-tp2 "$PY" bench/throughput.py --workload w4 --device cuda --mode in-process -tp 2 ;;
    32b-build) STAGE_TIMEOUT=400 stage 32b-build "$PY" bench/random_checkpoint.py --shape qwen3-32b --out /dev/shm/tandem-w1-qwen3-32b ;;
    32b-tp4) TAIL=12 STAGE_TIMEOUT=580 tp_debug stage 32b-tp4 "$PY" bench/throughput.py --workload w1 --shape qwen3-32b --device cuda --mode in-process -tp 4 --w1-dir /dev/shm/tandem-w1-qwen3-32b ;;
    # Issue 17 (fp8): the kernel, GEMM and engine tests, the fp8 decode bandwidth and GEMM figures,
    # the accuracy figures on the GPU, W1 with an fp8 KV cache, W4 (FP8 Qwen3-8B, then bf16 of the run).
    fp8-tests) TAIL=20 stage fp8-tests "$PY" -m pytest -q -m gpu tests/test_triton_kernels.py tests/test_fp8_gemm.py tests/test_fp8_kv.py -k "fp8 or w8a8 or quantize" ;;
    fp8-profile) TAIL=40 stage fp8-profile "$PY" bench/profile_step.py --steps 16 --fused-ops on --kv-cache-dtype fp8 ;;
    fp8-attention) TAIL=20 stage fp8-attention "$PY" bench/attention.py ;;
    store) TAIL=10 stage store "$PY" bench/attention.py --store ;;
    fp8-sweep) TAIL=20 stage fp8-sweep "$PY" bench/attention.py --sweep-fp8 ${FP8_BS:+--fp8-block-size $FP8_BS} ;;
    fp8-registers) TAIL=16 stage fp8-registers "$PY" bench/attention.py --sweep-fp8-registers ;;
    fp8-layout) TAIL=32 stage fp8-layout "$PY" bench/attention.py --sweep-layout ;;
    fp8-context) TAIL=10 stage fp8-context "$PY" bench/attention.py --sweep-context ;;
    # The decode tiles at 3 and 5-7 stages (whether two K/V buffers beat one), both caches.
    decode-stages) TAIL=50 STAGE_TIMEOUT=400 stage decode-stages "$PY" bench/attention.py --sweep-stages ;;
    # The fp8 decode kernel at block sizes 32-256 (V^T read in runs of 16 slots), then W1 fp8 at
    # BLOCK_SIZES (default 32 64 128) in turn, ROUNDS times (default 1).
    fp8-block-sizes) TAIL=8 stage fp8-block-sizes "$PY" bench/attention.py --sweep-fp8-block-sizes ;;
    w1-fp8-blocks) TAIL=20 STAGE_TIMEOUT=${STAGE_TIMEOUT:-560} stage w1-fp8-blocks bash -c 'for i in $(seq ${ROUNDS:-1}); do for b in ${BLOCK_SIZES:-32 64 128}; do echo "W1 fp8 block size $b ${W1_FLAGS:-}"; "$0" bench/throughput.py --workload w1 --device cuda --mode in-process --kv-cache-dtype fp8 --block-size $b ${W1_FLAGS:-} | grep "output tok/s\|device:"; done; done' "$PY" ;;
    fp8-mixed) TAIL=40 stage fp8-mixed "$PY" bench/attention.py --sweep-mixed-lengths ;;
    # The fused rotary kernel's K/V store, and the price of the e4m3 V cache's transposed layout.
    rope-tests) TAIL=8 stage rope-tests "$PY" -m pytest -q -m gpu tests/test_triton_ops.py -k "qk_norm_rope or rope_without" ;;
    rope-store) TAIL=20 stage rope-store bash -c '"$0" bench/rope_store.py && "$0" bench/rope_store.py --heads 32 8 --layers 36' "$PY" ;;
    # The fp8 decode kernel in programs of one or two warps (then W1 with a winner: w1-fp8-config).
    # Up to ~5 minutes on a cold Triton cache: alone in a device call (its 600 s cap), as the W1
    # stages of several runs below.
    decode-warps) TAIL=60 STAGE_TIMEOUT=500 stage decode-warps "$PY" bench/attention.py --sweep-warps ;;
    decode-warps-8b) TAIL=60 STAGE_TIMEOUT=500 stage decode-warps-8b "$PY" bench/attention.py --sweep-warps --heads 32 8 ;;
    fp8-engine-tests) TAIL=8 stage fp8-engine-tests "$PY" -m pytest -q -m gpu tests/test_fp8_kv.py tests/test_gpu_engine.py -k fp8 ;;
    # The Gluon fp8 GEMM's GPU tests (against v2 and the dequantized math) and its compiled K loop.
    gluon-tests) TAIL=8 stage gluon-tests "$PY" -m pytest -q tests/test_fp8_gemm.py -k "gluon" ;;
    fp8-kernel-tests) TAIL=8 stage fp8-kernel-tests "$PY" -m pytest -q -m gpu tests/test_triton_kernels.py -k "fp8" ;;
    # Nsight Compute on the decode kernel, bf16 and fp8 caches (where the machine's runtime gives
    # ncu the counters; the clocks left alone): what bounds the fp8 kernel.
    attention-ncu) TAIL=80 stage attention-ncu ncu --clock-control none -k regex:paged_ --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section SchedulerStats --section LaunchStats "$PY" bench/attention.py --ncu ;;
    # W1 split under py-spy (the engine core's threads sampled; bench/spy_split.sh), and the engine core alone on this host.
    w1-split1-spy) TAIL=8 stage w1-split1-spy env PY_SPY=/tmp/site/bin/py-spy OUT="$OUT" bash bench/spy_split.sh "$PY" bench/throughput.py --workload w1 --device cuda --mode split --stream-interval 1 ;;
    core-overhead) TAIL=8 stage core-overhead "$PY" bench/engine_core_overhead.py --workload w1 --freeze-heap ;;
    # The two-sequences-a-program decode prototype against paged_decode (agreement, then us and TB/s).
    decode-pairs) TAIL=12 stage decode-pairs "$PY" bench/decode_pairs.py ;;
    fp8-gemm) TAIL=30 stage fp8-gemm "$PY" bench/fp8_gemm.py ;;
    # The v2 GEMM's candidates at m = 64-512 against v1, bf16 and torch._scaled_mm (~2-3 min; the best per shape and GEMM_TABLE lines last).
    fp8-gemm-sweep) TAIL=40 stage fp8-gemm-sweep "$PY" bench/fp8_gemm.py --sweep-v2 ;;
    # The same at W4's full decode batch only (m = 256, ~40 s): the whole-M tiles (256 x 128, 16 warps, split-K) against today's choices.
    fp8-gemm-m256) TAIL=40 stage fp8-gemm-m256 "$PY" bench/fp8_gemm.py --sweep-v2 --tokens 256 ;;
    # The v2 and Gluon candidates at decode's few tokens (1, 8 and 32: narrow tiles, deep rings) against the first kernel's split-K rule, ~1 min.
    fp8-gemm-decode) TAIL=40 stage fp8-gemm-decode "$PY" bench/fp8_gemm.py --sweep-v2 --tokens 1,8,32 ;;
    # The v2 candidates at prefill's token counts (2,048 and 8,192; torch._scaled_mm is today's GEMM there), ~2 min.
    fp8-gemm-prefill) TAIL=40 stage fp8-gemm-prefill "$PY" bench/fp8_gemm.py --sweep-v2 --tokens 2048,8192 ;;
    # The Gluon prototype (bench/fp8_gemm_gluon.py: two K steps' wgmmas in flight, the first scaled while the second runs) against the v2 GEMM: checked on edge shapes, then timed (~40 s).
    fp8-gemm-gluon) TAIL=40 stage fp8-gemm-gluon "$PY" bench/fp8_gemm_gluon.py --gpu ;;
    # The decode kernel in e4m3 MMAs (FP8_MMA, off by default): its GPU tests; its tiles against today's
    # config (TB/s); its accuracy (every token a decode step: --chunk 1) against today's kernel's; W1
    # fp8 with it and without, alternating ROUNDS times (default 2).
    fp8-mma-tests) TAIL=12 STAGE_TIMEOUT=${STAGE_TIMEOUT:-400} stage fp8-mma-tests "$PY" -m pytest -q -m gpu tests/test_triton_kernels.py tests/test_fp8_kv.py -k "fp8_mma or cuda_graph_capturable or stores_kv_fp8 or fuses_rope_fp8" ;;
    fp8-mma) TAIL=40 STAGE_TIMEOUT=${STAGE_TIMEOUT:-400} stage fp8-mma "$PY" bench/attention.py --sweep-fp8-mma ${FP8_BS:+--fp8-block-size $FP8_BS} ;;
    # A dozen of those tests: each path once (tiles, FULL_TILES, splits, groups 2-8, the store and
    # rotary, CUDA graphs, the engine), for a call that must also time.
    fp8-mma-tests-quick) TAIL=12 STAGE_TIMEOUT=${STAGE_TIMEOUT:-200} stage fp8-mma-tests-quick "$PY" -m pytest -q -m gpu \
        "tests/test_triton_kernels.py::test_decode_fp8_mma[dtype0-32-tile1-5-2-scales1]" \
        "tests/test_triton_kernels.py::test_decode_fp8_mma[dtype0-32-tile3-1-2-scales1]" \
        "tests/test_triton_kernels.py::test_decode_fp8_mma[dtype1-16-tile0-1-8-scales0]" \
        "tests/test_triton_kernels.py::test_decode_fp8_mma[dtype0-32-tile2-5-4-scales1]" \
        "tests/test_triton_kernels.py::test_decode_fp8_mma[dtype0-256-tile4-1-8-scales1]" \
        "tests/test_triton_kernels.py::test_decode_fp8_mma_reads_v_in_runs_of_16[5]" \
        "tests/test_triton_kernels.py::test_decode_stores_kv_fp8[variant2-5-32]" \
        "tests/test_triton_kernels.py::test_decode_stores_kv_fp8[variant3-1-32]" \
        "tests/test_triton_kernels.py::test_decode_fuses_rope_fp8[variant1-5-True]" \
        "tests/test_triton_kernels.py::test_decode_fuses_rope_fp8[variant1-1-False]" \
        "tests/test_triton_kernels.py::test_decode_fp8_is_cuda_graph_capturable[True]" \
        "tests/test_fp8_kv.py::test_fp8_mma_decode_gives_the_tokens_of_the_widening_kernel[False]" ;;
    # Where FP8_MMA's greedy tokens part from the widening kernel's on the tests' random model, and the margin there.
    fp8-mma-divergence) TAIL=14 stage fp8-mma-divergence "$PY" bench/fp8_mma_divergence.py ;;
    # ... and on the trained embedded model (random prompts), then the engine test on it (CUDA graphs).
    fp8-mma-divergence-embedded) TAIL=14 stage fp8-mma-divergence-embedded bash -c '"$0" bench/fp8_mma_divergence.py --model "$("$0" -c "from protos.defaults import DEFAULT_MODEL; print(DEFAULT_MODEL)")"' "$PY" ;;
    fp8-mma-engine-test) TAIL=4 stage fp8-mma-engine-test "$PY" -m pytest -q -m gpu "tests/test_fp8_kv.py::test_fp8_mma_decode_gives_the_tokens_of_the_widening_kernel[False]" ;;
    # The fp8 GPU tests with FP8_MMA (its own tile, FP8_MMA_TILE) as the fp8 decode config's default: what adopting it would run.
    fp8-tests-mma) TAIL=20 STAGE_TIMEOUT=${STAGE_TIMEOUT:-400} stage fp8-tests-mma "$PY" -c 'import sys, pytest; from executor_service.attention import triton_kernels as tk; tk.DECODE_CONFIG_FP8.update(FP8_MMA=True); sys.exit(pytest.main(["-q", "-m", "gpu", "tests/test_triton_kernels.py", "tests/test_fp8_kv.py", "tests/test_gpu_engine.py", "-k", "fp8"]))' ;;
    fp8-mma-quick) TAIL=12 STAGE_TIMEOUT=${STAGE_TIMEOUT:-200} stage fp8-mma-quick "$PY" bench/attention.py --sweep-fp8-mma-quick ${FP8_BS:+--fp8-block-size $FP8_BS} ;;
    # W1 fp8 at block size BS (default 64) with FP8_MMA and as today, alternating ROUNDS times (default 1).
    w1-fp8-mma-bs) TAIL=14 STAGE_TIMEOUT=${STAGE_TIMEOUT:-450} stage w1-fp8-mma-bs bash -c 'for i in $(seq ${ROUNDS:-1}); do for c in "{\"FP8_MMA\": true, \"BLOCK_N\": 64, \"num_stages\": 2}" "{}"; do echo "W1 fp8 --block-size ${BS:-64} --decode-config $c"; "$0" bench/throughput.py --workload w1 --device cuda --mode in-process --kv-cache-dtype fp8 --block-size ${BS:-64} --decode-config "$c" | grep "output tok/s\|device:"; done; done' "$PY" ;;
    w1-fp8-presets) TAIL=${TAIL:-16} STAGE_TIMEOUT=${STAGE_TIMEOUT:-450} stage w1-fp8-presets bash -c w1_presets ;;
    # The decode tiles through TMA (TMA_KV): their GPU tests (the pointer loads' bits, the torch model, the engine,
    # the decode step's stores), then TMA against the pointer loads at blocks of TMA_BS (64 and 128:
    # 10 and 11 configs, ~20 s each; HEADS="32 8" for W4's).
    # (named by node id: on the device machine, -k "tma or stores_kv_fp8" ran all 418 GPU tests of the two files)
    fp8-tma-tests) TAIL=12 STAGE_TIMEOUT=${STAGE_TIMEOUT:-300} stage fp8-tma-tests "$PY" -m pytest -q -m gpu tests/test_triton_kernels.py::test_decode_fp8_mma_tma tests/test_triton_kernels.py::test_decode_fp8_tma_widening tests/test_triton_kernels.py::test_decode_stores_kv_fp8 tests/test_fp8_kv.py::test_tma_kv_gives_the_same_tokens_and_logprobs ;;
    fp8-tma-quick) TAIL=30 STAGE_TIMEOUT=${STAGE_TIMEOUT:-560} stage fp8-tma-quick bash -c 'for bs in ${TMA_BS:-64 128}; do "$0" bench/attention.py --sweep-fp8-tma --fp8-block-size $bs ${HEADS:+--heads $HEADS}; done' "$PY" ;;
    # The fp8 decode kernel's K/V gather alone (its math an XOR): the ceiling its TB/s can reach at each block size.
    kv-read-roofline) TAIL=8 stage kv-read-roofline "$PY" bench/kv_read_roofline.py ;;
    # The same at Qwen3-8B's heads (32 / 8: a GQA group of 4, W4's attention).
    fp8-mma-8b) TAIL=12 STAGE_TIMEOUT=${STAGE_TIMEOUT:-200} stage fp8-mma-8b "$PY" bench/attention.py --sweep-fp8-mma-quick --heads 32 8 ${FP8_BS:+--fp8-block-size $FP8_BS} ;;
    # W4 with FP8_MMA (64-key tiles, 2 stages) and as today, alternating ROUNDS times (default 1).
    w4-fp8-mma) TAIL=14 STAGE_TIMEOUT=${STAGE_TIMEOUT:-580} stage w4-fp8-mma bash -c 'for i in $(seq ${ROUNDS:-1}); do for c in "{\"FP8_MMA\": true, \"BLOCK_N\": 64, \"num_stages\": 2}" "{}"; do echo "W4 --decode-config $c"; "$0" bench/throughput.py --workload w4 --device cuda --mode in-process --decode-config "$c" | grep "output tok/s\|device:"; done; done' "$PY" ;;
    fp8-mma-accuracy) TAIL=12 stage fp8-mma-accuracy bash -c 'for c in "{}" "{\"FP8_MMA\": true}"; do "$0" bench/fp8_accuracy.py --device cuda --attention-backend triton --chunk 1 --tokens 4096 --decode-config "$c" | grep -v "^perplexity (b"; done' "$PY" ;;
    w1-fp8-mma) TAIL=14 STAGE_TIMEOUT=${STAGE_TIMEOUT:-450} stage w1-fp8-mma bash -c 'for i in $(seq ${ROUNDS:-2}); do for c in "{\"FP8_MMA\": true, \"BLOCK_N\": 64, \"num_stages\": 2}" "{}"; do echo "W1 fp8 --decode-config $c"; "$0" bench/throughput.py --workload w1 --device cuda --mode in-process --kv-cache-dtype fp8 --decode-config "$c" | grep "output tok/s\|device:"; done; done' "$PY" ;;
    fp8-accuracy) TAIL=6 stage fp8-accuracy "$PY" bench/fp8_accuracy.py --device cuda --attention-backend triton ;;
    fp8-weights-accuracy) TAIL=6 stage fp8-weights-accuracy "$PY" bench/fp8_accuracy.py --weights --device cuda --attention-backend triton ;;
    # Issue 17's three H200 target figures in one call (~6 min warm): the decode kernel at
    # b256x1024, W1 fp8 in-process twice and split once; W4 (fp8 weights and KV) then bf16 in a
    # second call: `bash bench/gpu_run.sh w4 w4-bf16`.
    h200-targets) for s in fp8-attention w1-fp8 w1-fp8 w1-fp8-split; do run "$s"; done ;;
    w1-fp8) TAIL=12 stage w1-fp8 "$PY" bench/throughput.py --workload w1 --device cuda --mode in-process --kv-cache-dtype fp8 ;;
    # W1 fp8 at prefill chunks of 8,192, 4,096 and 2,048 tokens (4,096 and under: piecewise CUDA
    # graphs), alternating, twice each.
    w1-fp8-chunks) TAIL=16 STAGE_TIMEOUT=580 stage w1-fp8-chunks bash -c 'for i in 1 2; do for t in 8192 4096 2048; do echo "max_num_batched_tokens $t"; "$0" bench/throughput.py --workload w1 --device cuda --mode in-process --kv-cache-dtype fp8 --max-num-batched-tokens $t | grep "output tok/s"; done; done' "$PY" ;;
    # W1 fp8 at a step budget of 8,192 tokens (the engine's default) and 16,384 (nano-vllm's and vLLM's
    # offline default on 80 GB+ GPUs: half the eager prefill steps), alternating, twice each.
    w1-fp8-budget) TAIL=16 STAGE_TIMEOUT=560 stage w1-fp8-budget bash -c 'for i in 1 2; do for t in 8192 16384; do echo "max_num_batched_tokens $t"; "$0" bench/throughput.py --workload w1 --device cuda --mode in-process --kv-cache-dtype fp8 --max-num-batched-tokens $t | grep "output tok/s\|device:"; done; done' "$PY" ;;
    # The GPU tests of the decode kernel storing a decode step's K and V (DECODE_STORES_KV) and
    # normalising and rotating q and K (DECODE_FUSES_ROPE); w1-fp8-leads times them.
    decode-kv-tests) TAIL=12 stage decode-kv-tests "$PY" -m pytest -q -m gpu tests/test_triton_kernels.py tests/test_fp8_kv.py -k "stores_kv or fuses_rope or store_kv_fp8 or fp8_kv_on_gpu" ;;
    # Issue 17's W1 leads in one stage: W1 fp8 with K/V stored by the rotary kernel at a step budget
    # of 8,192 tokens (the defaults until 2026-12-05), then with the decode kernel storing K/V, then
    # also normalising and rotating q and K, then that at the LLM class's budget on a large GPU
    # (16,384: today's defaults), in turn, ROUNDS times (default 2).
    w1-fp8-leads) TAIL=20 STAGE_TIMEOUT=${STAGE_TIMEOUT:-560} stage w1-fp8-leads bash -c 'for i in $(seq ${ROUNDS:-2}); do for f in "--decode-stores-kv off --max-num-batched-tokens 8192" "--decode-fuses-rope off --max-num-batched-tokens 8192" "--max-num-batched-tokens 8192" ""; do echo "W1 fp8 ${f:-as today}"; "$0" bench/throughput.py --workload w1 --device cuda --mode in-process --kv-cache-dtype fp8 $f | grep "output tok/s\|device:"; done; done' "$PY" ;;
    # W1 fp8 with DECODE_CONFIG (JSON) over the decode kernel's default launch configuration.
    w1-fp8-config) TAIL=12 stage w1-fp8-config "$PY" bench/throughput.py --workload w1 --device cuda --mode in-process --kv-cache-dtype fp8 --decode-config "${DECODE_CONFIG:-{\}}" ;;
    # Each in-process step's host time by phase (prepare, the eager model's modules, the sampler).
    host-phases) TAIL=${TAIL:-30} stage host-phases "$PY" bench/host_phases.py --workload w1 --device cuda --mode in-process --kv-cache-dtype ${KV_DTYPE:-fp8} ;;
    w1-gpu) TAIL=8 stage w1-gpu "$PY" bench/throughput.py --workload w1 --device cuda --mode in-process --profile-gpu ;;
    w1-fp8-gpu) TAIL=${TAIL:-8} stage w1-fp8-gpu "$PY" bench/throughput.py --workload w1 --device cuda --mode in-process --kv-cache-dtype fp8 --profile-gpu ;;
    # W1 fp8 as today and with the decode kernel's registers capped at MAXNREG (default 96: five
    # programs of 4 warps an SM instead of four), alternating, ROUNDS times (default 2).
    w1-fp8-maxnreg) TAIL=12 STAGE_TIMEOUT=${STAGE_TIMEOUT:-400} stage w1-fp8-maxnreg bash -c 'for i in $(seq ${ROUNDS:-2}); do for c in "{}" "{\"maxnreg\": ${MAXNREG:-96}}"; do echo "W1 fp8 decode config $c"; "$0" bench/throughput.py --workload w1 --device cuda --mode in-process --kv-cache-dtype fp8 --decode-config "$c" | grep "output tok/s\|device:"; done; done' "$PY" ;;
    # The GPU tests of the tiled e4m3 V store, then W1 fp8 with it from 512 tokens a launch (W1's
    # prefill chunks) and without, alternating, ROUNDS times (default 2).
    w1-fp8-vtiles) TAIL=14 STAGE_TIMEOUT=${STAGE_TIMEOUT:-450} stage w1-fp8-vtiles bash -c '"$0" -m pytest -q -m gpu tests/test_triton_kernels.py::test_store_kv_fp8_is_byte_exact tests/test_triton_ops.py::test_qk_norm_rope_stores_kv | tail -2; for i in $(seq ${ROUNDS:-2}); do for m in 512 -1; do echo "W1 fp8 --v-tile-min-tokens $m"; "$0" bench/throughput.py --workload w1 --device cuda --mode in-process --kv-cache-dtype fp8 --v-tile-min-tokens $m | grep "output tok/s\|device:"; done; done' "$PY" ;;
    w1-fp8-split) TAIL=12 stage w1-fp8-split "$PY" bench/throughput.py --workload w1 --device cuda --mode split --kv-cache-dtype fp8 ;;
    w4) TAIL=12 STAGE_TIMEOUT=580 stage w4 "$PY" bench/throughput.py --workload w4 --device cuda --mode in-process ;;
    w4-bf16) TAIL=12 STAGE_TIMEOUT=580 stage w4-bf16 "$PY" bench/throughput.py --workload w1 --shape qwen3-8b --device cuda --mode in-process ;;
    # The swap fp8 GEMM (decode's few tokens as the wgmma's narrow side, split-K summed in the kernel):
    # its GPU tests, then its candidates at 1-256 tokens against today's GEMMs (~5 min on a cold
    # Triton cache; the winners to $OUT/gemm_table.json), then W4 as today and with that table (or
    # TABLE=<a committed copy>), alternating, ROUNDS times (default 1).
    swap-tests) TAIL=8 stage swap-tests "$PY" -m pytest -q -m gpu tests/test_fp8_gemm.py -k "swap" ;;
    fp8-gemm-swap) TAIL=45 STAGE_TIMEOUT=${STAGE_TIMEOUT:-560} stage fp8-gemm-swap "$PY" bench/fp8_gemm.py --sweep-v2 --tokens ${SWAP_TOKENS:-1,2,4,8,16,32,64,128,256} --kernels swap --table-out "$OUT/gemm_table.json" ;;
    w4-swap) TAIL=16 STAGE_TIMEOUT=${STAGE_TIMEOUT:-580} stage w4-swap bash -c 'for i in $(seq ${ROUNDS:-1}); do for f in "" "--fp8-gemm-table ${TABLE:-$1/gemm_table.json}"; do echo "W4 ${f:-as today}"; "$0" bench/throughput.py --workload w4 --device cuda --mode in-process $f | grep "output tok/s\|device:\|GEMM_TABLE"; done; done' "$PY" "$OUT" ;;
    # W4 as today, then with the swap kernel's first rule (fp8_gemm_triton.swap_config) for the GEMMs of
    # up to SWAP_BELOW tokens (default 128), alternating ROUNDS times: no sweep needed first.
    w4-swap-rule) TAIL=16 STAGE_TIMEOUT=${STAGE_TIMEOUT:-580} stage w4-swap-rule bash -c 'for i in $(seq ${ROUNDS:-1}); do for f in "" "--fp8-gemm-swap-below ${SWAP_BELOW:-128}"; do echo "W4 ${f:-as today}"; "$0" bench/throughput.py --workload w4 --device cuda --mode in-process $f | grep "output tok/s\|device:\|swap"; done; done' "$PY" ;;
    # torch._scaled_mm's GEMMs of too few tiles as two K halves on two streams (SCALED_MM_SPLIT_K): its GPU test, the
    # GEMMs alone at 128 and 256 tokens (the "best" lines name the split's us), then W4 as today and with it,
    # alternating ROUNDS times (default 1).
    split-k-tests) TAIL=6 stage split-k-tests "$PY" -m pytest -q -m gpu "tests/test_fp8_gemm.py::test_scaled_mm_split_k_matches_the_whole_gemm_and_replays_in_a_cuda_graph" ;;
    fp8-gemm-split-k) TAIL=14 STAGE_TIMEOUT=${STAGE_TIMEOUT:-240} stage fp8-gemm-split-k bash -c '"$0" bench/fp8_gemm.py --sweep-v2 --tokens 128,256 --kernels v2 | grep "^best\|WRONG\|scaled_mm"' "$PY" ;;
    w4-split-k) TAIL=16 STAGE_TIMEOUT=${STAGE_TIMEOUT:-580} stage w4-split-k bash -c 'for i in $(seq ${ROUNDS:-1}); do for f in "" "--fp8-scaled-mm-split-k"; do echo "W4 ${f:-as today}"; "$0" bench/throughput.py --workload w4 --device cuda --mode in-process $f | grep "output tok/s\|device:\|two K halves"; done; done' "$PY" ;;
    # W4's decode step by kernel group at batches of 16, 64 and 128 (after a w4 stage built the
    # checkpoint), with TABLE=<GEMM_TABLE entries> if given: where the smaller steps' time goes.
    w4-profile-batches) TAIL=60 STAGE_TIMEOUT=${STAGE_TIMEOUT:-400} stage w4-profile-batches bash -c 'for b in 16 64 128; do "$0" bench/profile_step.py --model /tmp/tandem-w1-qwen3-8b-fp8 --batch $b --steps 16 --top 8 --fused-ops on --kv-cache-dtype fp8 ${TABLE:+--fp8-gemm-table $TABLE}; done' "$PY" ;;
    # W4's decode step at batch 256 over contexts of 256-1024 tokens (attention's time against its
    # bytes: a fixed cost a program shows as the intercept), then at 512 with the K/V store and
    # rotary in the fused rotary kernel instead of the decode kernel (after a w4 stage built the checkpoint).
    w4-profile-contexts) TAIL=40 STAGE_TIMEOUT=${STAGE_TIMEOUT:-400} stage w4-profile-contexts bash -c 'for c in 256 512 1024 "512 --decode-stores-kv off"; do "$0" bench/profile_step.py --model /tmp/tandem-w1-qwen3-8b-fp8 --context $c --steps 8 --top 3 --fused-ops on --kv-cache-dtype fp8 2>&1 | grep -v Warn; done' "$PY" ;;
    # The decode kernel's own K/V store and rotary (DECODE_STORES_KV, DECODE_FUSES_ROPE) against the
    # fused rotary kernel's, at Qwen3-8B's 32 / 8 heads: W4's step at batch 256 and context 512,
    # alternating twice (after w4-checkpoint); then W4 end to end, each way once untimed (each
    # variant's first compiles), then alternating ROUNDS times (default 2).
    w4-stores-ab) TAIL=30 STAGE_TIMEOUT=${STAGE_TIMEOUT:-200} stage w4-stores-ab bash -c 'for f in on off on off; do "$0" bench/profile_step.py --model /tmp/tandem-w1-qwen3-8b-fp8 --steps 8 --top 2 --fused-ops on --kv-cache-dtype fp8 --decode-stores-kv $f 2>&1 | grep "decode step at\|by group\|us x"; done' "$PY" ;;
    w4-stores-e2e) TAIL=30 STAGE_TIMEOUT=${STAGE_TIMEOUT:-590} stage w4-stores-e2e bash -c 'for f in on off $(for i in $(seq ${ROUNDS:-2}); do echo off on; done); do echo "W4 --decode-stores-kv $f"; "$0" bench/throughput.py --workload w4 --device cuda --mode in-process --decode-stores-kv $f | grep "output tok/s\|device:"; done' "$PY" ;;
    # The decode kernel's own key from registers (DECODE_NEW_KEY_REGS): its GPU tests (36), then
    # W4's step at batch 256 / context 512 alternating on / off twice (after w4-checkpoint), then W1
    # fp8 and W4 end to end, one untimed run of each first.
    new-key-tests) TAIL=6 STAGE_TIMEOUT=${STAGE_TIMEOUT:-400} stage new-key-tests "$PY" -m pytest -q -m gpu tests/test_triton_kernels.py::test_decode_new_key_regs_fp8 ;;
    new-key-profile) TAIL=30 STAGE_TIMEOUT=${STAGE_TIMEOUT:-200} stage new-key-profile bash -c 'for f in on off on off; do "$0" bench/profile_step.py --model /tmp/tandem-w1-qwen3-8b-fp8 --steps 8 --top 2 --fused-ops on --kv-cache-dtype fp8 --decode-new-key-regs $f 2>&1 | grep "decode step at\|by group\|us x"; done' "$PY" ;;
    new-key-w1) TAIL=30 STAGE_TIMEOUT=${STAGE_TIMEOUT:-300} stage new-key-w1 bash -c 'for f in on off $(for i in $(seq ${ROUNDS:-2}); do echo on off; done); do echo "W1 fp8 --decode-new-key-regs $f"; "$0" bench/throughput.py --workload w1 --device cuda --mode in-process --kv-cache-dtype fp8 --decode-new-key-regs $f | grep "output tok/s\|device:"; done' "$PY" ;;
    new-key-w4) TAIL=30 STAGE_TIMEOUT=${STAGE_TIMEOUT:-590} stage new-key-w4 bash -c 'for f in on off $(for i in $(seq ${ROUNDS:-2}); do echo on off; done); do echo "W4 --decode-new-key-regs $f"; "$0" bench/throughput.py --workload w4 --device cuda --mode in-process --decode-new-key-regs $f | grep "output tok/s\|device:"; done' "$PY" ;;
    # W4's ratio as the issue states it: bf16 Qwen3-8B and W4 on one machine, one untimed run of
    # each first (a shape's first run on a machine compiles its kernels inside the timed window:
    # 2026-12-06), then alternating ROUNDS times (default 1); FLAGS: extra flags for the W4 runs,
    # split at spaces (write JSON values without any: --decode-config {"NEW_KEY_REGS":true}).
    w4-ratio) TAIL=20 STAGE_TIMEOUT=${STAGE_TIMEOUT:-590} stage w4-ratio bash -c 'for i in $(seq 0 ${ROUNDS:-1}); do for w in bf16 fp8; do echo "round $i (0: untimed) $w"; if [ $w = bf16 ]; then a=(--workload w1 --shape qwen3-8b); else a=(--workload w4 ${FLAGS:-}); fi; "$0" bench/throughput.py "${a[@]}" --device cuda --mode in-process --trace-compiles | grep "output tok/s\|device:\|first launched\|^ *[0-9.]* s  "; done; done' "$PY" ;;
    # The Triton fp8 GEMMs' split-K summed in the kernel (SPLIT_K_SUM_IN_KERNEL): its GPU tests, then W4
    # alternating (after one untimed run of each), ROUNDS times (default 2).
    sum-in-kernel-tests) TAIL=6 STAGE_TIMEOUT=${STAGE_TIMEOUT:-300} stage sum-in-kernel-tests "$PY" -m pytest -q -m gpu tests/test_fp8_gemm.py -k "summed_in_the_kernel" ;;
    w4-sum-in-kernel) TAIL=30 STAGE_TIMEOUT=${STAGE_TIMEOUT:-590} stage w4-sum-in-kernel bash -c 'for f in on off $(for i in $(seq ${ROUNDS:-2}); do echo on off; done); do echo "W4 split-K in the kernel: $f"; if [ $f = on ]; then a=(--fp8-gemm-sum-in-kernel); else a=(); fi; "$0" bench/throughput.py --workload w4 --device cuda --mode in-process "${a[@]}" | grep "output tok/s\|device:"; done' "$PY" ;;
    # RMSNorm and SiLU-and-mul over launch shapes (bench/fused_ops.py), Qwen3-8B's widths then
    # Qwen3-0.6B's; its "table" lines are --fused-op-launch entries for w4-fused-ops.
    fused-ops) TAIL=40 STAGE_TIMEOUT=${STAGE_TIMEOUT:-300} stage fused-ops bash -c '"$0" bench/fused_ops.py && "$0" bench/fused_ops.py --shape qwen3-0.6b --tokens 16,64,256,2048' "$PY" ;;
    # The sweep at W4's widths, then W4 with its winners (if any) against today's: one call.
    fused-ops-ab) TAIL=40 STAGE_TIMEOUT=${STAGE_TIMEOUT:-200} stage fused-ops-sweep "$PY" bench/fused_ops.py --tokens 16,64,256,16384 --launch-out "$OUT/fused_op_launch.json"
        if [ ! -s "$OUT/fused_op_launch.json" ]; then
            echo "   the sweep wrote no launch shapes (it failed or ran out of time: fused-ops-sweep.log): W4 not run" | tee -a "$OUT/summary.txt"
        elif [ "$(cat "$OUT/fused_op_launch.json")" = "{}" ]; then
            echo "   no launch shape beats the defaults: W4 not run" | tee -a "$OUT/summary.txt"
        else
            LAUNCH=$(cat "$OUT/fused_op_launch.json") ROUNDS=${ROUNDS:-1} run w4-fused-ops
        fi ;;
    # W4 with LAUNCH='<--fused-op-launch JSON>' against today's, alternating ROUNDS times (default 2)
    # after one untimed run of each (their first compiles).
    w4-fused-ops) TAIL=30 STAGE_TIMEOUT=${STAGE_TIMEOUT:-590} stage w4-fused-ops bash -c 'for i in $(seq $((${ROUNDS:-2} + 1))); do for f in today launch; do echo "W4 $f (round $i; round 1 untimed)"; if [ $f = launch ]; then a=(--fused-op-launch "${LAUNCH:?LAUNCH=<--fused-op-launch JSON> is needed}"); else a=(); fi; "$0" bench/throughput.py --workload w4 --device cuda --mode in-process "${a[@]}" | grep "output tok/s\|device:\|launch shapes"; done; done' "$PY" ;;
    # The W4 checkpoint (random Qwen3-8B in the FP8 format, /tmp/tandem-w1-qwen3-8b-fp8) alone, for
    # the profile stages on a fresh machine.
    w4-checkpoint) stage w4-checkpoint env PYTHONPATH="${PYTHONPATH:-$PWD}:$PWD/bench" "$PY" -c 'from pathlib import Path; from bench.throughput import build_w1_checkpoint; print(build_w1_checkpoint(Path("/tmp/tandem-w1-qwen3-8b-fp8"), "qwen3-8b", "fp8"))' ;;
    w4-profile) TAIL=40 stage w4-profile "$PY" bench/profile_step.py --model /tmp/tandem-w1-qwen3-8b-fp8 --steps 16 --fused-ops on --kv-cache-dtype fp8 ;;
    *) echo "unknown stage $1" | tee -a "$OUT/summary.txt" ;;
    esac
}

for what in "$@"; do
    run "$what"
done
