"""Offline throughput, in-process (`LLM`) and through the gRPC split (executor + scheduler as two
subprocesses; every request streamed at once from --num-client-processes client processes, each
one connection). Prints output tokens/s of each and their ratio.

    python bench/throughput.py                      # CPU: the embedded model, 64 requests
    python bench/throughput.py --workload w1 --device cuda     # BENCH.md W1 (Qwen3-0.6B shape)
    python bench/throughput.py --workload w3 --device cuda     # BENCH.md W3 (Qwen3-30B-A3B shape)
    python bench/throughput.py --workload w1 --shape llama-3.2-1b --device cuda
    python bench/throughput.py --workload w1 --device cuda --kv-cache-dtype fp8          # W1, fp8 KV
    python bench/throughput.py --workload w4 --device cuda --mode in-process             # W4: Qwen3-8B
        FP8 weights + fp8 KV, then the bf16 Qwen3-8B of the same run (random checkpoints)

Requests have token-id prompts, random (seeded) prompt and output lengths and ignore_eos, so
every run generates exactly the same number of tokens. Time runs from submitting the first
request to the last token, after a warm-up (the split: each client process warms its connection).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gc_times import GCTimes
from client.defaults import DEFAULT_HOST, DEFAULT_MODEL, free_port

# BENCH.md W1: Qwen3-0.6B's shape, random bf16 weights.
W1_CONFIG = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    eos_token_id=151645,
    bos_token_id=None,
)
# Issue 8's larger shape: Qwen3-8B's architecture (untied head), random bf16 weights.
QWEN3_8B_CONFIG = {
    **W1_CONFIG,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}
SHAPES = {"qwen3-0.6b": W1_CONFIG, "qwen3-8b": QWEN3_8B_CONFIG}
# Shapes written as random tensors without a model init (bench/random_checkpoint.py): W3's MoE,
# Llama 3.2 1B's and Qwen3-32B's (65.5 GB: for TP=4).
RANDOM_SHAPES = ("qwen3-30b-a3b", "llama-3.2-1b", "qwen3-32b")
# --quantization fp8: the shape written as a random FP8 block-scaled checkpoint (random_checkpoint.py).
FP8_SHAPES = ("qwen3-8b",)
W3_FLOOR_TOK_S = 7500  # BENCH.md: W3's floor on the H200 (61 GB of experts read per decode step)
W1_TOTALS = (142_827, 133_966)  # prompt, output tokens
W1_FLOOR_S = 3.7  # BENCH.md: the H200's floor for W1 (weights and KV cache read at copy bandwidth)


@dataclass
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


def add_service_flags(p: argparse.ArgumentParser, stream_interval: int) -> None:
    """The flags of the services a benchmark starts (this one's and bench/serve.py's; start_services
    reads them)."""
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="the executor's TP size")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the step budget (default: each mode's own, the LLM class's in-process: 16,384 on a GPU of "
        "70 GiB or more other than an A100, else 8,192; the services' 8,192 in the split)",
    )
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: the executor's (kv-cache-gb)")
    p.add_argument(
        "--max-prefill-tokens-while-decoding",
        type=int,
        default=0,
        help="the scheduler's prefill budget per step while requests decode (default 0: none)",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=stream_interval,
        help=f"the scheduler's --stream-interval: tokens per streamed chunk (default {stream_interval}; "
        "1 streams every token)",
    )
    p.add_argument(
        "--api-server-count",
        type=int,
        default=None,
        help="the scheduler's --api-server-count (default: its own)",
    )
    p.add_argument(
        "--max-plans-in-flight",
        type=int,
        choices=[1, 2, 3],
        default=3,
        help="plans sent before the oldest result is read (default 3, the scheduler service's; "
        "in-process the executor takes at most 2; 1: no overlap)",
    )
    p.add_argument(
        "--fused-ops",
        choices=["auto", "on", "off"],
        default="auto",
        help="the executor's Triton-fused norm/rotary/SiLU kernels (default auto: on CUDA)",
    )
    p.add_argument("--kv-cache-dtype", default="auto", help="the executor's --kv-cache-dtype (auto, fp8)")
    p.add_argument(
        "--block-size", type=int, default=None, help="tokens per KV block (default: the executor's)"
    )
    p.add_argument(
        "--executor-cmd",
        default=None,
        help='command that starts the executor (default: "python -m executor_service"), e.g. under a profiler '
        "or bench/stub_executor.py",
    )
    p.add_argument("--executor-arg", action="append", default=[], help="extra executor flag (repeatable)")
    p.add_argument("--scheduler-arg", action="append", default=[], help="extra scheduler flag (repeatable)")
    p.add_argument("--keep-logs", action="store_true", help="print where the services' logs are")
    p.add_argument(
        "--executor-cpus",
        help="split: the executor on these CPUs (a taskset list, as 0-3) and this process, the "
        "scheduler and the clients on the others, as containers with their own cores would run",
    )
    p.add_argument(
        "--log-idle-ms",
        type=float,
        help="split: the executor logs each wait of the device for a plan of this many ms or more, "
        "with the step it came before; the first 60 are printed",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--workload",
        choices=["random", "w1", "w3", "w4"],
        default="random",
        help="random: the flags below; w1: BENCH.md W1 (256 requests, 100-1024 in and out, T=0.6); "
        "w3: W1's requests on the Qwen3-30B-A3B shape (61 GB, built in /dev/shm unless --w1-dir); "
        "w4: W1's requests on a random FP8 checkpoint of Qwen3-8B's shape with an fp8 KV cache",
    )
    p.add_argument("--model", default=None, help="checkpoint directory (default: embedded model; w1: built)")
    p.add_argument(
        "--shape",
        choices=sorted([*SHAPES, *RANDOM_SHAPES]),
        default="qwen3-0.6b",
        help="w1: the architecture of the built checkpoint (default qwen3-0.6b, BENCH.md's W1)",
    )
    p.add_argument(
        "--w1-dir", default=None, help="where the w1 checkpoint is built (default: a temp dir per shape)"
    )
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt-len", type=int, default=16)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--min-output-len", type=int, default=16)
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--temperature", type=float, default=None, help="default 0 (greedy); w1: 0.6")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload")
    p.add_argument("--mode", choices=["both", "in-process", "split"], default="both")
    p.add_argument(
        "--num-client-processes",
        type=int,
        default=1,
        help="split: client processes streaming the requests, each its own connection (default 1; more "
        "spread the streams over the API servers, and compete with the services for the machine's cores)",
    )
    add_service_flags(p, stream_interval=16)
    p.add_argument(
        "--profile-gpu",
        action="store_true",
        help="in-process: the timed run under torch.profiler, then where its wall time went on the "
        "GPU (kernel time by group, idle time and the gaps between kernels)",
    )
    p.add_argument(
        "--trace-compiles",
        action="store_true",
        help="in-process: list the Triton kernel variants first launched during the timed run "
        "(each a compile, or a load from Triton's disk cache)",
    )
    p.add_argument(
        "--peer",
        default=None,
        metavar="SCRIPT",
        help="after tandem, run this peer script (e.g. ../shared/peers/hf_continuous_batching.py) in the "
        "same run and print its output tok/s next to tandem's; PEER_N requests (default all 256)",
    )
    p.add_argument(
        "--quantization",
        choices=["none", "fp8"],
        default="none",
        help="fp8: the built checkpoint is a random FP8 block-scaled one (--shape qwen3-8b)",
    )
    p.add_argument(
        "--allocator-reserve-mb",
        type=int,
        default=0,
        help="in-process, after the warm-up: take a block of this many MiB and give it back to torch's "
        "caching allocator (an experiment: whether the timed run then needs no new segment)",
    )
    p.add_argument(
        "--decode-config",
        default=None,
        metavar="JSON",
        help="in-process: keys that override the decode attention kernel's launch configuration for "
        'this run\'s cache dtype (attention/triton_kernels.py), e.g. \'{"BLOCK_N": 32, "num_warps": 1, '
        '"split_below": 24, "split_to": 48}\'; with FP8_MMA on, BLOCK_N / num_warps / num_stages are '
        "FP8_MMA_TILE's",
    )
    p.add_argument(
        "--decode-stores-kv",
        choices=["on", "off"],
        default=None,
        help="in-process, fp8 KV: whether a decode step's K and V are stored by the decode attention "
        "kernel (attention/triton_kernels.DECODE_STORES_KV, on by default) or by the fused rotary "
        "kernel; rank 0 only under tensor parallelism (its other ranks are processes of their own)",
    )
    p.add_argument(
        "--v-tile-min-tokens",
        type=int,
        default=None,
        help="in-process, fp8 KV: launches of at least this many tokens store V through "
        "store_v_tiles_kernel (attention/triton_kernels.V_TILE_MIN_TOKENS, 512 by default); -1: never",
    )
    p.add_argument(
        "--decode-fuses-rope",
        choices=["on", "off"],
        default=None,
        help="with the decode kernel storing K/V: whether it also normalises and rotates q and the new "
        "K (attention/triton_kernels.DECODE_FUSES_ROPE, on by default), so a decode step runs no "
        "rotary kernel",
    )
    p.add_argument(
        "--decode-new-key-regs",
        choices=["on", "off"],
        default=None,
        help="in-process, with the decode kernel storing K/V: whether it attends to the step's key from "
        "registers, no barrier before its loop (attention/triton_kernels.DECODE_NEW_KEY_REGS, off by default)",
    )
    p.add_argument(
        "--fused-op-launch",
        default=None,
        metavar="JSON",
        help="in-process: launch shapes of the fused RMSNorm and SiLU-and-mul by row width "
        '(layers/triton_ops.py), e.g. \'{"rms_norm_warps": {"4096": 8}, "silu_and_mul_tiles": {"12288": [2048, 8]}}\' '
        "(bench/fused_ops.py prints such entries)",
    )
    add_fp8_gemm_flags(p)
    args = p.parse_args(argv)
    if args.decode_fuses_rope == "on" and args.decode_stores_kv == "off":
        p.error("--decode-fuses-rope on needs the decode kernel to store K/V (not --decode-stores-kv off)")
    if (
        args.decode_config is not None
        or args.decode_stores_kv is not None
        or args.decode_fuses_rope is not None
        or args.v_tile_min_tokens is not None
        or args.fp8_gemm_table
        or args.fp8_gemm_swap_below
        or args.fp8_scaled_mm_split_k
        or args.fp8_gemm_sum_in_kernel
        or args.fused_op_launch
        or args.decode_new_key_regs is not None
    ) and args.mode != "in-process":
        p.error(
            "--decode-config, --decode-stores-kv, --decode-fuses-rope, --decode-new-key-regs, --fused-op-launch "
            "and the --fp8-gemm flags change this process's kernels: they need --mode in-process"
        )
    if args.fused_op_launch:
        try:
            launch = json.loads(args.fused_op_launch)
            unknown = set(launch) - {"rms_norm_warps", "silu_and_mul_tiles"}
            if unknown:
                raise ValueError(f"unknown keys {sorted(unknown)}")
            args.rms_norm_warps = {int(k): int(v) for k, v in launch.get("rms_norm_warps", {}).items()}
            args.silu_and_mul_tiles = {
                int(k): (int(v[0]), int(v[1])) for k, v in launch.get("silu_and_mul_tiles", {}).items()
            }
            bad = [cols for cols, _ in args.silu_and_mul_tiles.values() if cols < 128 or cols & (cols - 1)]
            if bad:
                raise ValueError(f"SiLU-and-mul programs of {bad[0]} columns: a power of 2 >= 128 is needed")
            warps = [*args.rms_norm_warps.values(), *(w for _, w in args.silu_and_mul_tiles.values())]
            bad = [w for w in warps if not 1 <= w <= 32 or w & (w - 1)]
            if bad:
                raise ValueError(f"{bad[0]} warps: a power of 2 from 1 to 32 is needed")
        except (ValueError, TypeError, IndexError, AttributeError) as e:
            p.error(f"--fused-op-launch: {e}")
    if args.profile_gpu and not args.device.startswith("cuda"):
        p.error("--profile-gpu profiles CUDA kernels: it needs --device cuda")
    if args.workload == "w4":  # BENCH.md W4: Qwen3-8B's shape, FP8 weights and an fp8 KV cache
        args.shape, args.quantization, args.kv_cache_dtype = "qwen3-8b", "fp8", "fp8"
    if args.quantization == "fp8" and args.shape not in FP8_SHAPES:
        p.error(f"--quantization fp8 builds a random checkpoint of {', '.join(FP8_SHAPES)} only")
    if args.workload == "w3":
        args.shape = "qwen3-30b-a3b"
    if args.w1_dir is None:
        # 61 GB: memory-backed /dev/shm where there is one (the GPU machine's disk is 64 GiB).
        big = args.shape in ("qwen3-30b-a3b", "qwen3-32b") and Path("/dev/shm").is_dir()
        suffix = "-fp8" if args.quantization == "fp8" else ""
        args.w1_dir = str(
            Path("/dev/shm" if big else tempfile.gettempdir()) / f"tandem-w1-{args.shape}{suffix}"
        )
    if args.workload in ("w1", "w3", "w4"):
        args.num_requests = 256
        args.min_prompt_len, args.max_prompt_len = 100, 1024
        args.min_output_len, args.max_output_len = 100, 1024
        if args.temperature is None:
            args.temperature = 0.6
    if args.temperature is None:
        args.temperature = 0.0
    return args


def add_fp8_gemm_flags(p: argparse.ArgumentParser) -> None:
    """--fp8-gemm-table, --fp8-gemm-swap-below, --fp8-scaled-mm-split-k and --fp8-gemm-sum-in-kernel (apply_fp8_gemm_flags sets
    them): this process's fp8 GEMMs (in-process runs; fp8 weights)."""
    p.add_argument(
        "--fp8-gemm-table",
        metavar="FILE",
        help="in-process, fp8 weights: GEMM_TABLE entries to add (layers/fp8_gemm_triton; the JSON "
        "that bench/fp8_gemm.py --sweep-v2 --table-out writes)",
    )
    p.add_argument(
        "--fp8-gemm-swap-below",
        type=int,
        default=0,
        metavar="N",
        help="in-process, fp8 weights: the swap kernel's rule (fp8_gemm_triton.swap_config) for the "
        "fp8 GEMMs of up to N tokens (fp8_gemm_triton.SWAP_MAX_TOKENS; 0: off, today's default)",
    )
    p.add_argument(
        "--fp8-scaled-mm-split-k",
        action="store_true",
        help="in-process, fp8 weights: torch._scaled_mm's GEMMs of too few tiles to fill the SMs as two "
        "K halves on two streams (fp8_gemm_triton.SCALED_MM_SPLIT_K; off by default)",
    )
    p.add_argument(
        "--fp8-gemm-sum-in-kernel",
        action="store_true",
        help="in-process, fp8 weights: the Triton GEMMs' split-K sums added by each tile's last split in "
        "the kernel, in split order, instead of atomically into a zeroed buffer copied after "
        "(fp8_gemm_triton.SPLIT_K_SUM_IN_KERNEL; off by default)",
    )


def apply_fp8_gemm_flags(args: argparse.Namespace) -> None:
    """--fp8-gemm-table's entries into fp8_gemm_triton.GEMM_TABLE, --fp8-gemm-swap-below into its
    SWAP_MAX_TOKENS, --fp8-scaled-mm-split-k into SCALED_MM_SPLIT_K, --fp8-gemm-sum-in-kernel into
    SPLIT_K_SUM_IN_KERNEL (this process's fp8 GEMMs)."""
    if not (
        args.fp8_gemm_table
        or args.fp8_gemm_swap_below
        or args.fp8_scaled_mm_split_k
        or args.fp8_gemm_sum_in_kernel
    ):
        return
    from executor_service.layers import fp8_gemm_triton

    entries = json.loads(Path(args.fp8_gemm_table).read_text()) if args.fp8_gemm_table else []
    for bucket, n, k, cfg in entries:
        if bucket not in fp8_gemm_triton.M_BUCKETS:
            raise SystemExit(
                f"--fp8-gemm-table: {bucket} is not a token bucket ({fp8_gemm_triton.M_BUCKETS})"
            )
        fp8_gemm_triton.GEMM_TABLE[bucket, n, k] = cfg
        print(f"GEMM_TABLE[{bucket}, {n}, {k}] = {cfg}")
    fp8_gemm_triton.SWAP_MAX_TOKENS = args.fp8_gemm_swap_below
    if args.fp8_gemm_swap_below:
        print(f"the fp8 GEMMs of up to {args.fp8_gemm_swap_below} tokens: the swap kernel's rule")
    fp8_gemm_triton.SCALED_MM_SPLIT_K = args.fp8_scaled_mm_split_k
    if args.fp8_scaled_mm_split_k:
        print("torch._scaled_mm's GEMMs of too few tiles: two K halves on two streams")
    fp8_gemm_triton.SPLIT_K_SUM_IN_KERNEL = args.fp8_gemm_sum_in_kernel
    if args.fp8_gemm_sum_in_kernel:
        print("the Triton GEMMs' split-K: summed in the kernel by each tile's last split")


def build_w1_checkpoint(out_dir: Path, shape: str = "qwen3-0.6b", quantization: str = "none") -> Path:
    """A Qwen3 architecture (SHAPES) with random bf16 weights, saved through transformers. The
    8B shape is initialised on the GPU when there is one (on the CPU it needs ~32 GB and minutes).
    RANDOM_SHAPES are written as random tensors (bench/random_checkpoint.py)."""
    if (out_dir / "config.json").is_file() and any(out_dir.glob("*.safetensors")):
        return out_dir
    if shape in RANDOM_SHAPES or quantization == "fp8":
        from random_checkpoint import build_random_checkpoint

        return build_random_checkpoint(out_dir, shape, fp8=quantization == "fp8")
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    print(f"building the {shape} checkpoint in {out_dir} ...", flush=True)
    torch.manual_seed(0)
    config = Qwen3Config(**SHAPES[shape], dtype="bfloat16")
    if shape == "qwen3-0.6b":
        with torch.device("cpu"):
            model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    else:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                model = Qwen3ForCausalLM(config)
        finally:
            torch.set_default_dtype(default)
    model.save_pretrained(out_dir, safe_serialization=True)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out_dir


def make_workload(args: argparse.Namespace, vocab_size: int) -> list[Request]:
    # W1's recipe (nano-vllm's bench): draw all prompts first, then all max_tokens.
    rng = random.Random(args.seed)
    top = min(10000, vocab_size - 1)
    prompts = [
        [rng.randint(0, top) for _ in range(rng.randint(args.min_prompt_len, args.max_prompt_len))]
        for _ in range(args.num_requests)
    ]
    outputs = [rng.randint(args.min_output_len, args.max_output_len) for _ in range(args.num_requests)]
    return [Request(p, n) for p, n in zip(prompts, outputs)]


def run_in_process(args: argparse.Namespace, model: str, workload: list[Request]) -> tuple[int, float]:
    from client.llm import LLM
    from scheduler_service.sampling_params import SamplingParams

    options = {"num_kv_blocks": args.num_kv_blocks} if args.num_kv_blocks else {}
    if args.block_size is not None:
        options["block_size"] = args.block_size
    if args.tensor_parallel_size > 1:  # the ranks take this level: each logs its plan broadcast latency
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    llm = LLM(
        model,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        fused_ops=args.fused_ops,
        tensor_parallel_size=args.tensor_parallel_size,
        max_plans_in_flight=min(args.max_plans_in_flight, 2),  # in-process the executor takes two
        kv_cache_dtype=args.kv_cache_dtype,
        max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
        **options,
    )
    print(f"in-process step budget: {llm.engine.scheduler.config.max_num_batched_tokens} tokens", flush=True)
    warm = [r.prompt_token_ids for r in workload[:4]]
    llm.generate(warm, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    if args.allocator_reserve_mb:  # a block taken and given back: the caching allocator keeps it
        import torch

        torch.empty(args.allocator_reserve_mb << 20, dtype=torch.uint8, device=args.device)
    segments0 = cuda_segments(args.device)
    params = [
        SamplingParams(max_tokens=r.max_tokens, temperature=args.temperature, ignore_eos=True)
        for r in workload
    ]
    compiles: list[tuple[float, str]] = []
    if args.trace_compiles:
        from triton import knobs

        def on_compile(**kwargs) -> None:  # Triton's hook at each in-memory cache miss
            compiles.append((time.perf_counter(), kwargs["repr"]))

        knobs.runtime.jit_cache_hook = on_compile
    steps0 = llm.engine.scheduler.stats.num_steps
    profiler = None
    host_steps: list[tuple] = []
    if args.profile_gpu:
        import torch

        record_host_steps(llm.engine.executor, host_steps)
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        profiler.start()
    timeline = llm.executor.device_timeline
    device0 = timeline.totals() if timeline is not None else None
    gc_times = GCTimes()
    memory0 = cuda_allocator_counts(args.device)
    t0, cpu0 = time.perf_counter(), time.process_time()
    outputs = llm.generate([r.prompt_token_ids for r in workload], params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    gc_times.stop()
    print(f"garbage collections in the timed in-process run: {gc_times}")
    if memory0:
        counts = cuda_allocator_counts(args.device)
        new = sorted(
            size >> 20 for address, size in cuda_segments(args.device).items() if address not in segments0
        )
        print(
            "CUDA caching allocator in the timed run (each cudaMalloc / cudaFree waits for the device): "
            + ", ".join(f"{k} {counts[k] - memory0[k]}" for k in counts)
            + f"; new segments (MiB): {new}"
        )
    if device0 is not None:
        busy, gaps, count = (now - before for now, before in zip(timeline.totals(), device0, strict=True))
        print(f"in-process device: {device_line(busy, gaps, count, elapsed)}")
    if profiler is not None:
        profiler.stop()
        print_gpu_time(profiler, elapsed, llm.engine.scheduler.stats.num_steps - steps0)
        print_host_steps(host_steps, t0)
    if args.trace_compiles:
        knobs.runtime.jit_cache_hook = None
        print(f"kernel variants first launched in the timed run: {len(compiles)}")
        for at, what in compiles:
            print(f"  {at - t0:7.2f} s  {what[:400]}")
    tokens = sum(len(o.token_ids) for o in outputs)
    llm.executor.close()  # stops the TP ranks, if any
    del llm, outputs
    gc.collect()
    if args.device.startswith("cuda"):  # the split's executor sizes its KV cache from free memory
        import torch

        torch.cuda.empty_cache()
    return tokens, elapsed, cpu


def record_host_steps(executor, log: list[tuple]) -> None:
    """Wrap the in-process executor's send / receive: (what, step id, tokens, new sequences, start,
    end) of each call goes into log."""
    send, receive = executor.send, executor.receive

    def timed(fn, what):
        def call(plan):
            start = time.perf_counter()
            out = fn(plan)
            log.append(
                (
                    what,
                    plan.step_id,
                    sum(plan.num_scheduled_tokens),
                    len(plan.new_seqs),
                    start,
                    time.perf_counter(),
                )
            )
            return out

        return call

    executor.send, executor.receive = timed(send, "send"), timed(receive, "receive")


def cuda_allocator_counts(device: str) -> dict[str, int]:
    """torch's caching allocator: segments taken from and given back to the driver, and the retries
    after a failed cudaMalloc (which free the cache first); empty off CUDA."""
    if not device.startswith("cuda"):
        return {}
    import torch

    stats = torch.cuda.memory_stats()
    keys = (
        "segment.all.allocated",
        "segment.all.freed",
        "num_alloc_retries",
        "num_device_alloc",
        "num_device_free",
    )
    return {k: int(stats.get(k, 0)) for k in keys}


def cuda_segments(device: str) -> dict[int, int]:
    """The caching allocator's segments: address -> bytes (empty off CUDA)."""
    if not device.startswith("cuda"):
        return {}
    import torch

    return {seg["address"]: seg["total_size"] for seg in torch.cuda.memory_snapshot()}


def print_host_steps(log: list[tuple], t0: float, first_s: float = 1.0) -> None:
    """The host's side of the run's first second: each step's send (schedule done: prepare and
    launch) and receive (the wait for its sampled ids), ms since the run started."""
    print(f"host, the first {first_s:g} s (ms since the start: send = prepare + launch, receive = the wait):")
    for what, step, tokens, new, start, end in log:
        if start - t0 > first_s:
            break
        print(
            f"  {(start - t0) * 1e3:8.2f} {what:7s} step {step:4d} ({tokens:5d} tokens, {new:3d} new): {(end - start) * 1e3:6.2f} ms"
        )


def print_gpu_time(profiler, elapsed: float, steps: int) -> None:
    """Where a profiled run's wall time went on the GPU: kernel time by group (bench/profile_step.py's
    groups), the time no kernel ran, and the gaps between kernels by length (a gap of tens of us
    or more is the device waiting on the host: a step's plan, its inputs or a launch)."""
    import torch

    from bench.profile_step import group_of

    spans, by_kernel = [], defaultdict(lambda: [0.0, 0])  # by kernel: seconds, launches
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            start, end = event.time_range.start, event.time_range.end
            spans.append((start, end, event.name))
            by_kernel[event.name][0] += (end - start) / 1e6
            by_kernel[event.name][1] += 1
    groups = defaultdict(float)
    for name, (seconds, _) in by_kernel.items():
        groups[group_of(name)] += seconds
    spans.sort()
    busy, gaps = 0.0, []  # gaps: (seconds, us since the first kernel, the kernels before and after)
    first = edge = spans[0][0] if spans else 0
    before = ""
    for start, end, name in spans:
        if start > edge:
            gaps.append(((start - edge) / 1e6, edge - first, before, name))
        if end > edge:
            busy += (end - max(start, edge)) / 1e6
            edge, before = end, name
    kernels = sum(groups.values())
    print(
        f"GPU: {steps} steps in {elapsed:.2f} s; kernels {kernels:.2f} s ({busy:.2f} s busy, "
        f"{busy / elapsed:.0%} of the wall time, {busy / max(steps, 1) * 1e3:.2f} ms a step); by group: "
        + ", ".join(f"{g} {t:.2f} s" for g, t in sorted(groups.items(), key=lambda x: -x[1]))
    )
    for low, high in ((0, 1e-5), (1e-5, 1e-4), (1e-4, 1e-3), (1e-3, float("inf"))):
        chosen = [g[0] for g in gaps if low <= g[0] < high]
        print(
            f"  gaps between kernels {low * 1e6:.0f}-{high * 1e6:.0f} us: {len(chosen)}, {sum(chosen):.3f} s"
        )
    window = 0.25  # seconds of the run; its idle time in gaps of 100 us or more
    idle = defaultdict(float)
    for seconds, at, _, _ in gaps:
        if seconds >= 1e-4:
            idle[int(at / 1e6 / window)] += seconds
    print(
        f"  idle in gaps >= 100 us by {window} s of the run: "
        + " ".join(f"{idle.get(i, 0.0) * 1e3:.0f}" for i in range(int(elapsed / window) + 1))
        + " ms"
    )
    # Kernel time by group in each half second of the run: the first windows hold W1's prefill
    # chunks (eager steps of thousands of tokens), the later ones its decode steps.
    windows = defaultdict(lambda: defaultdict(float))
    for start, end, name in spans:
        windows[int((start - first) / 1e6 / 0.5)][group_of(name)] += (end - start) / 1e6
    for i in sorted(windows)[:4]:
        row = sorted(windows[i].items(), key=lambda x: -x[1])
        print(
            f"  kernels in {i * 0.5:.1f}-{i * 0.5 + 0.5:.1f} s: {sum(windows[i].values()) * 1e3:.0f} ms; "
            + ", ".join(f"{g} {t * 1e3:.0f}" for g, t in row)
        )
    for name, (seconds, n) in sorted(by_kernel.items(), key=lambda x: -x[1][0])[:24]:
        print(f"  {seconds:6.3f} s {seconds / n * 1e6:8.1f} us x {n:6d}  {name[:90]}")
    early = [g for g in gaps if g[0] >= 1e-3 and g[1] < 1e6]
    print(
        "  gaps of 1 ms or more in the first second (ms since the first kernel: length): "
        + ", ".join(f"{g[1] / 1e3:.1f}: {g[0] * 1e3:.2f}" for g in early)
    )
    for seconds, at, before, after in sorted(gaps, reverse=True)[:8]:
        print(f"  gap {seconds * 1e3:.2f} ms at {at / 1e6:.3f} s: after {before[:60]}, before {after[:60]}")


def cpu_list(text: str) -> set[int]:
    """A taskset CPU list ("0-3,8") as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def start_services(args: argparse.Namespace, model: str, log_dir: Path):
    from client.up import Service

    host = DEFAULT_HOST
    executor_port, scheduler_port = free_port(), free_port()
    executor_metrics, scheduler_metrics = free_port(), free_port()
    executor_cmd = (
        shlex.split(args.executor_cmd) if args.executor_cmd else [sys.executable, "-m", "executor_service"]
    )
    executor_argv = [*executor_cmd, "--model", model, "--host", host]
    if args.executor_cpus:
        cpus = cpu_list(args.executor_cpus)
        executor_argv = ["taskset", "-c", args.executor_cpus, *executor_argv]
        os.sched_setaffinity(0, os.sched_getaffinity(0) - cpus)  # inherited by the scheduler and clients
    executor_argv += ["--port", str(executor_port), "--metrics-port", str(executor_metrics)]
    executor_argv += ["--device", args.device, "--max-num-seqs", str(args.max_num_seqs)]
    if args.max_num_batched_tokens is not None:
        executor_argv += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    executor_argv += ["--fused-ops", args.fused_ops, "--kv-cache-dtype", args.kv_cache_dtype]
    executor_argv += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.dtype:
        executor_argv += ["--dtype", args.dtype]
    if args.num_kv_blocks:
        executor_argv += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.block_size is not None:
        executor_argv += ["--block-size", str(args.block_size)]
    executor_argv += args.executor_arg
    scheduler_argv = [sys.executable, "-m", "scheduler_service", "--executor", f"{host}:{executor_port}"]
    scheduler_argv += [
        "--host",
        host,
        "--port",
        str(scheduler_port),
        "--metrics-port",
        str(scheduler_metrics),
        "--http-port",  # W1 measures the gRPC front end
        "0",
    ]
    scheduler_argv += ["--max-num-seqs", str(args.max_num_seqs)]
    if args.max_num_batched_tokens is not None:
        scheduler_argv += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    scheduler_argv += ["--stream-interval", str(args.stream_interval)]
    if args.api_server_count is not None:
        scheduler_argv += ["--api-server-count", str(args.api_server_count)]
    scheduler_argv += ["--max-plans-in-flight", str(args.max_plans_in_flight)]
    scheduler_argv += ["--max-prefill-tokens-while-decoding", str(args.max_prefill_tokens_while_decoding)]
    scheduler_argv += args.scheduler_arg
    executor_env = None
    if args.log_idle_ms is not None:
        from executor_service.servicer import LOG_IDLE_MS_ENV

        executor_env = {**os.environ, LOG_IDLE_MS_ENV: str(args.log_idle_ms)}
    executor = Service("executor", executor_argv, log_dir / "executor.log", env=executor_env)
    scheduler = Service("scheduler", scheduler_argv, log_dir / "scheduler.log")
    ports = {
        "executor": f"{host}:{executor_port}",
        "scheduler": f"{host}:{scheduler_port}",
        "executor_metrics": f"http://{host}:{executor_metrics}/metrics",
        "scheduler_metrics": f"http://{host}:{scheduler_metrics}/metrics",
    }
    return executor, scheduler, ports


def wait_serving(service, address: str, timeout: float = 600.0) -> None:
    from client.up import _wait_serving

    failure = _wait_serving(service, address, timeout, threading.Event())
    if failure is not None:
        raise SystemExit(f"{failure}; the last lines of {service.log_path}:\n{service.tail()}")


def _stat_cpu_seconds(stat: Path) -> float | None:
    """User + system CPU seconds from a /proc stat file (a process's or a thread's); None if gone."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all threads (Linux /proc; 0 elsewhere)."""
    return _stat_cpu_seconds(Path(f"/proc/{pid}/stat")) or 0.0


def thread_cpu(pid: int) -> dict[int, float]:
    """User + system CPU seconds of each thread of `pid` (Linux /proc)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        seconds = _stat_cpu_seconds(task / "stat")
        if seconds is not None:
            out[int(task.name)] = seconds
    return out


def child_pids(pid: int) -> list[int]:
    """The live child processes of `pid` (Linux /proc)."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return children


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
            if sample.name == "tandem_executor_idle_seconds_bucket":  # the gaps' distribution
                key = f"{sample.name}:{sample.labels['le']}"
                values[key] = values.get(key, 0.0) + sample.value
    return values


def device_line(busy: float, gaps: float, count: int, elapsed: float) -> str:
    """The device timeline's sums over a run (executor_service/device_timeline.py)."""
    return (
        f"{busy:.2f} s in steps ({busy / elapsed:.0%} of the wall time), {count} gaps between steps, "
        f"{gaps * 1e3:.0f} ms in all"
    )


def idle_gaps(steps: dict[str, float]) -> str:
    """The executor's gaps between steps (tandem_executor_idle_seconds) during the timed run: how
    many, their total, and the share of it in gaps over 1 ms (a few long stalls, or many short)."""
    count = int(steps.get("tandem_executor_idle_seconds_count", 0))
    if not count:
        return "no gaps between steps"
    total = steps["tandem_executor_idle_seconds_sum"]
    short = steps.get("tandem_executor_idle_seconds_bucket:0.001", 0.0)
    return (
        f"{count} gaps between steps, {total * 1e3:.0f} ms in all, {count - short:.0f} of them over 1 ms "
        f"({steps.get('tandem_executor_idle_seconds_bucket:0.0001', 0.0):.0f} under 0.1 ms)"
    )


def run_split(args: argparse.Namespace, model: str, workload: list[Request]) -> tuple[int, float, dict]:
    log_dir = Path(tempfile.mkdtemp(prefix="tandem-bench-"))
    executor, scheduler, ports = start_services(args, model, log_dir)
    services = [scheduler, executor]
    try:
        executor.start()
        wait_serving(executor, ports["executor"])
        scheduler.start()
        wait_serving(scheduler, ports["scheduler"])
        from serve import load_from_processes

        pid = scheduler.process.pid
        api_servers = child_pids(pid)  # --api-server-count: the scheduler is the engine core
        counters = {}

        def before_timed_run() -> None:
            counters["metrics"] = scrape(ports["executor_metrics"])
            counters["cpu"] = {s.name: cpu_seconds(s.process.pid) for s in services}
            counters["api"] = {p: cpu_seconds(p) for p in api_servers}
            counters["threads"] = thread_cpu(pid)

        # Each client process is one connection (one HTTP/2 channel, so one API server takes all
        # its streams) and warms it first; the counters are read once every process is ready.
        records, client_cpu, t0 = load_from_processes(
            ports["scheduler"],
            workload,
            [0.0] * len(workload),
            args.temperature,
            args.num_client_processes,
            warm=2,
            on_ready=before_timed_run,
        )
        failed = [r for r in records if r["error"]]
        if failed:
            raise SystemExit(f"{len(failed)} requests failed, the first: {failed[0]['error']}")
        tokens = sum(r["output_tokens"] for r in records)
        elapsed = max(r["chunks"][-1] for r in records if r["chunks"]) - t0
        before = counters["metrics"]
        threads = {t: v - counters["threads"].get(t, 0.0) for t, v in thread_cpu(pid).items()}
        cpu = {s.name: cpu_seconds(s.process.pid) - counters["cpu"][s.name] for s in services}
        if api_servers:
            per_server = [cpu_seconds(p) - counters["api"][p] for p in api_servers]
            cpu[f"{len(api_servers)} API servers"] = sum(per_server)
            cpu["the busiest API server"] = max(per_server)
        if len(client_cpu) == 1:
            cpu["client"] = client_cpu[0]["cpu_s"]
        else:
            cpu[f"{len(client_cpu)} client processes"] = sum(c["cpu_s"] for c in client_cpu)
            cpu["the busiest client"] = max(c["cpu_s"] for c in client_cpu)
        after = scrape(ports["executor_metrics"])
        steps = {
            k: after.get(k, 0.0) - before.get(k, 0.0)
            for k in (
                "tandem_executor_step_duration_seconds_sum",
                "tandem_executor_step_duration_seconds_count",
                "tandem_executor_idle_seconds_sum",
                "tandem_executor_idle_seconds_count",
                "tandem_executor_idle_seconds_bucket:0.0001",
                "tandem_executor_idle_seconds_bucket:0.001",
                "tandem_executor_device_busy_seconds_total",
                "tandem_executor_device_gap_seconds_sum",
                "tandem_executor_device_gap_seconds_count",
            )
        }
        steps["cpu"] = cpu
        # The scheduler's main thread (the asyncio loop) and its other threads, busiest first
        # (the engine thread, then ZeroMQ's and gRPC's own I/O threads).
        steps["threads"] = [threads.pop(pid, 0.0), *sorted(threads.values(), reverse=True)[:3]]
        steps["api_servers"] = len(api_servers)
    finally:
        for service in services:
            service.stop(10.0)
    if args.keep_logs:
        print(f"service logs: {log_dir}")
    idle_lines = []
    for line in (log_dir / "executor.log").read_text(errors="replace").splitlines():
        if "plan broadcast over" in line:  # the TP ranks', at close
            print(f"split executor: {line}")
        elif "device idle" in line:
            idle_lines.append(line)
    if args.log_idle_ms is not None:
        print(f"split executor: {len(idle_lines)} waits of {args.log_idle_ms} ms or more for a plan")
        for line in idle_lines[:60]:
            print(f"  {line}")
    return tokens, elapsed, steps


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model is None:
        args.model = (
            str(build_w1_checkpoint(Path(args.w1_dir), args.shape, args.quantization))
            if args.workload in ("w1", "w3", "w4")
            else str(DEFAULT_MODEL)
        )
    vocab_size = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    workload = make_workload(args, vocab_size)
    num_prompt = sum(len(r.prompt_token_ids) for r in workload)
    num_output = sum(r.max_tokens for r in workload)
    print(f"command: python {shlex.join(sys.argv)}")
    print(
        f"workload: {args.workload}, {len(workload)} requests, {num_prompt} prompt tokens, {num_output} output "
        f"tokens (longest {max(r.max_tokens for r in workload)}), temperature {args.temperature}, "
        f"model {args.model}, device {args.device}, max_num_seqs {args.max_num_seqs}, "
        f"split stream interval {args.stream_interval}"
    )
    if args.workload in ("w1", "w3", "w4") and (num_prompt, num_output) != W1_TOTALS:
        print(f"warning: W1 expects {W1_TOTALS} prompt/output tokens", file=sys.stderr)

    results = {}

    def floor(elapsed: float) -> str:
        if args.workload == "w3" and args.tensor_parallel_size == 1:
            return f"; {num_output / elapsed / W3_FLOOR_TOK_S:.0%} of the ~{W3_FLOOR_TOK_S} tok/s floor"
        if args.workload != "w1" or args.shape != "qwen3-0.6b" or args.tensor_parallel_size != 1:
            return ""
        return f"; the {W1_FLOOR_S} s floor is {W1_FLOOR_S / elapsed:.0%} of it"

    if args.decode_config is not None:
        from executor_service.attention import triton_kernels

        fp8 = args.kv_cache_dtype in ("fp8", "fp8_e4m3")
        config = triton_kernels.DECODE_CONFIG_FP8 if fp8 else triton_kernels.DECODE_CONFIG
        overrides = json.loads(args.decode_config)
        if fp8 and overrides.get("FP8_MMA", config.get("FP8_MMA")):  # the tile keys are FP8_MMA's own tile's
            tile = triton_kernels.FP8_MMA_TILE
            tile.update({k: overrides.pop(k) for k in list(overrides) if k in tile})
            print(f"FP8_MMA's tile: {tile}")
        config.update(overrides)
        print(f"decode config ({'fp8' if fp8 else 'bf16'} cache): {config}")
    if args.decode_new_key_regs is not None:
        from executor_service.attention import triton_kernels

        triton_kernels.DECODE_NEW_KEY_REGS = args.decode_new_key_regs == "on"
        print(f"the decode kernel's own key from registers: {args.decode_new_key_regs}")
    if args.fused_op_launch:
        from executor_service.layers import triton_ops

        triton_ops.RMS_NORM_WARPS.update(args.rms_norm_warps)
        triton_ops.SILU_AND_MUL_TILES.update(args.silu_and_mul_tiles)
        print(
            f"fused ops' launch shapes: RMSNorm warps {triton_ops.RMS_NORM_WARPS}, SiLU-and-mul tiles {triton_ops.SILU_AND_MUL_TILES}"
        )
    if args.v_tile_min_tokens is not None:
        from executor_service.attention import triton_kernels

        triton_kernels.V_TILE_MIN_TOKENS = None if args.v_tile_min_tokens < 0 else args.v_tile_min_tokens
        print(f"e4m3 V stored in tiles from {triton_kernels.V_TILE_MIN_TOKENS} tokens a launch")
    if args.decode_stores_kv is not None or args.decode_fuses_rope is not None:
        from executor_service.attention import triton_kernels

        if args.decode_stores_kv is not None:
            triton_kernels.DECODE_STORES_KV = args.decode_stores_kv == "on"
        if args.decode_fuses_rope is not None:
            triton_kernels.DECODE_FUSES_ROPE = args.decode_fuses_rope == "on"
        fuses_rope = triton_kernels.DECODE_STORES_KV and triton_kernels.DECODE_FUSES_ROPE
        print(
            "a decode step's K and V: stored by "
            + (
                "the decode attention kernel"
                if triton_kernels.DECODE_STORES_KV
                else "the fused rotary kernel"
            )
            + (", which also normalises and rotates q and K" if fuses_rope else "")
        )
    apply_fp8_gemm_flags(args)
    if args.mode in ("both", "in-process"):
        tokens, elapsed, cpu = run_in_process(args, args.model, workload)
        results["in-process"] = tokens / elapsed
        print(
            f"in-process: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} output tok/s "
            f"(CPU time {cpu:.1f} s{floor(elapsed)})",
            flush=True,
        )
    if args.mode in ("both", "split"):
        tokens, elapsed, steps = run_split(args, args.model, workload)
        results["split"] = tokens / elapsed
        busy = steps["tandem_executor_step_duration_seconds_sum"]
        count = int(steps["tandem_executor_step_duration_seconds_count"])
        idle = max(0.0, elapsed - busy)
        print(
            f"split: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} output tok/s "
            f"(executor: {count} steps, {busy:.2f} s in steps = {busy / elapsed:.0%} of the wall time, "
            f"idle {idle / max(count, 1) * 1e3:.2f} ms per step: {idle_gaps(steps)}; "
            f"CPU time: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in steps["cpu"].items())
            + f"{floor(elapsed)})",
            flush=True,
        )
        if steps["tandem_executor_device_busy_seconds_total"]:  # CUDA
            line = device_line(
                steps["tandem_executor_device_busy_seconds_total"],
                steps["tandem_executor_device_gap_seconds_sum"],
                int(steps["tandem_executor_device_gap_seconds_count"]),
                elapsed,
            )
            print(f"split device: {line}", flush=True)
        print(
            f"{'engine core' if steps['api_servers'] else 'scheduler'} CPU per output token: "
            f"{steps['cpu']['scheduler'] / max(tokens, 1) * 1e6:.1f} us (its threads: the loop "
            f"{steps['threads'][0]:.2f} s, the busiest others "
            + ", ".join(f"{v:.2f}" for v in steps["threads"][1:])
            + " s)",
            flush=True,
        )
        if tokens != num_output:
            print(f"warning: the client received {tokens} tokens, expected {num_output}", file=sys.stderr)
    if len(results) == 2:
        ratio = results["split"] / results["in-process"]
        label = "CPU" if args.device == "cpu" else "GPU"
        print(f"{label} split/in-process: {ratio:.3f}")
    if args.workload in ("w1", "w3", "w4"):
        label = args.workload.upper()
        if args.workload == "w1" and (args.shape != "qwen3-0.6b" or args.tensor_parallel_size != 1):
            label += f" {args.shape}"  # "W1 qwen3-0.6b TP=2 split, ...": issue 19's line
        if args.tensor_parallel_size != 1 or (args.shape == "qwen3-8b" and args.workload != "w4"):
            label += f" TP={args.tensor_parallel_size}"
        fp8 = [what for what, on in (("fp8 weights", args.quantization == "fp8"),
                                     ("fp8 KV", args.kv_cache_dtype in ("fp8", "fp8_e4m3"))) if on]  # fmt: skip
        note = f" ({', '.join(fp8)})" if fp8 else ""
        for mode, rate in results.items():
            interval = (
                f", stream interval {args.stream_interval}"
                if mode == "split" and args.stream_interval == 1
                else ""
            )
            print(f"{label} {mode}{interval}{note}: {rate:.0f} output tok/s")
    if args.peer:
        peer = run_peer(args.peer)
        print(
            f"peer {peer['peer']} ({peer['n']} requests): {peer['tok_per_s']:.1f} output tok/s in {peer['seconds']} s"
        )
        for mode, rate in results.items():
            print(f"tandem {mode} / peer: {rate / peer['tok_per_s']:.1f}x")
    return 0


def run_peer(script: str) -> dict:
    """The peer script in its own process (it builds its own model); its last line is JSON."""
    env = {**os.environ, "N": os.environ.get("PEER_N", "256")}
    result = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"the peer {script} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
