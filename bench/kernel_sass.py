"""The decode attention kernel compiled for Hopper (sm90) on a machine without a GPU: its registers
per thread, shared memory, and the SASS of its main loop (how many instructions a tile of keys
costs, and which). Triton compiles for a given target without a device, and its wheel ships
cuobjdump; nothing is launched. A proxy for the GPU's timing where the kernel is bound by issuing
instructions (the fp8 decode kernel: bench/RESULTS.md), not a measurement.

    python bench/kernel_sass.py                        # the fp8 cache's default decode config
    python bench/kernel_sass.py --kv bf16 --block-n 64 # the bf16 one
    python bench/kernel_sass.py --block-n 64 --warps 1 --maxnreg 168 --top 30
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from executor_service.attention import triton_kernels as tk

_SCALARS = {"qk_scale": "fp32", "k_scale": "fp32", "v_scale": "fp32", "eps": "fp32", "num_heads": "i32"}
# Strides the engine's caches and views always have as multiples of 16 elements.
_ALIGNED_STRIDES = (
    "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cb", "stride_cs", "stride_ch",
    "stride_vb", "stride_vh", "stride_vd", "stride_nkt", "stride_nkh", "stride_nvt", "stride_nvh", "stride_rope",
)  # fmt: skip


def compile_sm90(
    fn, constants: dict, types: dict[str, str], aligned, num_warps: int, num_stages: int | None = None,
    maxnreg: int = 0, source_cls=ASTSource, fp_fusion: bool = True,
):  # fmt: skip
    """fn compiled for sm90 without a GPU. `constants`: its constexprs (and any argument made one);
    `types`: the Triton type of each other argument by name (i32 where not named); pointers and
    the `aligned` arguments are declared 16-byte divisible. source_cls: Gluon's GluonASTSource for
    a Gluon kernel."""
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in fn.arg_names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if (name.endswith("_ptr") or name in aligned) and name not in constants
    }
    source = source_cls(
        fn=fn,
        signature=signature,
        constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()},
        attrs=attrs,
    )
    options = {"num_warps": num_warps, "enable_fp_fusion": fp_fusion}
    if num_stages is not None:
        options["num_stages"] = num_stages
    if maxnreg:
        options["maxnreg"] = maxnreg
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def compile_decode(
    kv: str,
    block_n: int,
    warps: int,
    stages: int,
    maxnreg: int,
    group: int,
    head_dim: int,
    block_q: int = 1,
    block_size: int = 16,
    group_pad: int = 0,
    store_kv: bool = False,
    rope: bool = False,
    fp8_mma: bool = False,
    full_tiles: bool = False,
    tma_kv: bool = False,
    new_key_regs: bool = False,
):
    """The decode kernel (BLOCK_Q 1, no splits, every row of query length 1) for sm90; with
    block_q > 1 the prefill launch of paged_attention_kernel (paged_prefill's rows); tma_kv: K and
    V^T through TMA descriptors (TMA_KV; e4m3 decode); new_key_regs: with store_kv, the step's key
    from registers (NEW_KEY_REGS)."""
    fn = tk.paged_attention_kernel
    cache = "*fp8e4nv" if kv == "fp8" else "*bf16"
    constants = {
        "BLOCK_SIZE": block_size,
        "GROUP": group,
        "GROUP_PAD": group_pad or max((8 if fp8_mma else 16) // block_q, triton.next_power_of_2(group)),
        "BLOCK_N": block_n,
        "HEAD_DIM": head_dim,
        "BLOCK_D": triton.next_power_of_2(head_dim),
        "NUM_SPLITS": 1,
        "ROWS": 0 if block_q == 1 else 2,
        "KV_FP8": kv == "fp8",
        "BLOCK_Q": block_q,
        "DOT_PRECISION": "tf32",
        "FP8_DOT_F16": kv == "fp8" and block_q == 1,
        "STORE_KV": store_kv or rope,
        "ROPE": rope,
        "HAS_NORM": rope,
        "FP8_MMA": fp8_mma,
        "INTERPRETER": False,
        "FULL_TILES": full_tiles,
        "TMA_KV": tma_kv,
        "NEW_KEY_REGS": new_key_regs,
    }
    int_ptrs = ("block_tables_ptr", "context_lens_ptr", "cu_seqlens_q_ptr", "seq_order_ptr")
    types = {name: "*i32" if name in int_ptrs else "*bf16" for name in fn.arg_names if name.endswith("_ptr")}
    types["slot_mapping_ptr"] = "*i64"
    types["cos_sin_ptr"] = "*fp32"
    types.update(k_cache_ptr=cache, v_cache_ptr=cache, **_SCALARS)
    if tma_kv:
        d = triton.next_power_of_2(head_dim)
        types.update(
            k_desc=f"tensordesc<fp8e4nv[{block_n}, {d}]>", v_desc=f"tensordesc<fp8e4nv[{d}, {block_n}]>"
        )
    # paged_decode compiles the fp8 decode kernel without FMA fusion (triton_kernels.py).
    fp_fusion = not (kv == "fp8" and block_q == 1)
    return compile_sm90(fn, constants, types, _ALIGNED_STRIDES, warps, stages, maxnreg, fp_fusion=fp_fusion)


def cuobjdump(*args: str) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return subprocess.run([str(tool), *args], capture_output=True, text=True, check=True).stdout


def loops(sass: str) -> list[list[str]]:
    """The opcodes (predicates dropped) of every backward branch's body, in SASS order."""
    index: dict[int, int] = {}  # address -> position
    instructions = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            index[int(m.group(1), 16)] = len(instructions)
            instructions.append(m.group(2))
    opcodes = []
    for text in instructions:
        m = re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)", text)
        opcodes.append(m.group(1) if m else "")
    edges = []  # (branch position, target position, predicated)
    for i, text in enumerate(instructions):
        target = re.search(r"\bBRA\s+(?:`\()?0x([0-9a-f]+)", text)
        start = index.get(int(target.group(1), 16)) if target else None
        if start is not None and start < i:
            edges.append((i, start, text.startswith("@")))
    bodies = []
    for i, start, predicated in edges:
        # An unconditional jump back into a loop's body from past its back edge is the return of an
        # out-of-line slow path (an mbarrier wait's retry loop, say), not a loop of its own.
        if not predicated and any(p and s <= start <= j < i for j, s, p in edges):
            continue
        bodies.append([op for op in opcodes[start : i + 1] if op])
    return bodies


def loop_body(sass: str) -> list[str]:
    """The opcodes of the longest backward branch's body (the loop over key tiles)."""
    return max(loops(sass), key=len, default=[])


def loop_stats(kernel) -> tuple[list[str], str]:
    """A compiled kernel's loop opcodes (loop_body) and its registers a thread."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = cuobjdump("--dump-resource-usage", cubin.name)
        ops = loop_body(cuobjdump("-sass", cubin.name))
    registers = re.search(r"REG:(\d+)", usage)
    return ops, registers.group(1) if registers else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv", choices=("fp8", "bf16"), default="fp8", help="the cache's dtype")
    parser.add_argument("--block-n", type=int, help="keys per tile (default: the decode config's)")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--maxnreg", type=int, help="register cap (default: the decode config's; 0: none)")
    parser.add_argument("--group", type=int, default=2, help="query heads per KV head (Qwen3-0.6B: 2)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per cache block")
    parser.add_argument("--group-pad", type=int, default=0, help="query rows per KV head (default: >= 16)")
    parser.add_argument("--top", type=int, default=16, help="opcodes to list")
    parser.add_argument(
        "--store-kv", action="store_true", help="the decode kernel storing the step's K/V (DECODE_STORES_KV)"
    )
    parser.add_argument(
        "--rope",
        action="store_true",
        help="... and normalising and rotating q and the new K itself (DECODE_FUSES_ROPE)",
    )
    parser.add_argument(
        "--fp8-mma", action="store_true", help="the decode loop in e4m3 MMAs (DECODE_CONFIG_FP8's FP8_MMA)"
    )
    parser.add_argument(
        "--full-tiles",
        action="store_true",
        help="with --fp8-mma: the unmasked tiles' loop, then the last tile's (FULL_TILES); prints both",
    )
    parser.add_argument(
        "--tma-kv",
        action="store_true",
        help="K and V^T tiles through TMA (TMA_KV; blocks of BLOCK_N or more)",
    )
    parser.add_argument(
        "--new-key-regs",
        action="store_true",
        help="with --store-kv: the step's key from registers, no barrier (DECODE_NEW_KEY_REGS)",
    )
    parser.add_argument(
        "--prefill",
        action="store_true",
        help="paged_prefill's launch (PREFILL_CONFIG's tiles) instead of decode",
    )
    args = parser.parse_args()
    if args.tma_kv and (args.kv != "fp8" or args.prefill):
        parser.error("--tma-kv: the decode kernel over an e4m3 cache")
    if args.group_pad and (args.group_pad & (args.group_pad - 1) or args.group_pad < args.group):
        parser.error(f"--group-pad must be a power of 2 of at least --group ({args.group})")

    config = tk.DECODE_CONFIG_FP8 if args.kv == "fp8" else tk.DECODE_CONFIG
    block_q = 1
    if args.prefill:
        config = tk.PREFILL_CONFIG
        block_q = max(config["BLOCK_M"] // triton.next_power_of_2(args.group), 1)
        args.warps, args.stages = config["num_warps"], config["num_stages"]
    block_n = args.block_n or config["BLOCK_N"]
    maxnreg = config.get("maxnreg", 0) if args.maxnreg is None else args.maxnreg
    kernel = compile_decode(
        args.kv, block_n, args.warps, args.stages, maxnreg if args.kv == "fp8" else args.maxnreg or 0,
        args.group, args.head_dim, block_q, args.block_size, args.group_pad, args.store_kv, args.rope,
        args.fp8_mma, args.full_tiles, args.tma_kv, args.new_key_regs,
    )  # fmt: skip
    ops, registers = loop_stats(kernel)
    name = "paged_attention_kernel"
    if args.prefill:
        name += f" (prefill, {block_q} query tokens a tile)"
    tile_bytes = 2 * block_n * args.head_dim * (1 if args.kv == "fp8" else 2)
    print(
        f"{name}, {args.kv} cache, BLOCK_N {block_n}, {args.warps} warps, {args.stages} stages, "
        f"maxnreg {maxnreg or 'none'}: {registers} registers a thread, "
        f"{kernel.metadata.shared} bytes of shared memory"
    )
    print(
        f"loop: {len(ops)} instructions per tile of {block_n} keys ({tile_bytes // 1024} KB of K and V: "
        f"{len(ops) / (tile_bytes / 1024):.1f} per KB)"
    )
    for op, count in collections.Counter(ops).most_common(args.top):
        print(f"  {count:5d} {op}")
    if args.full_tiles:  # two tile loops: the full tiles' (most of the keys), then the last tile's
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(kernel.asm["cubin"])
            cubin.flush()
            mma_loops = [b for b in loops(cuobjdump("-sass", cubin.name)) if any("MMA" in op for op in b)]
        for what, body in zip(("full tiles (unmasked)", "last tile (masked)"), mma_loops, strict=False):
            print(f"loop over the {what}: {len(body)} instructions per tile")


if __name__ == "__main__":
    main()
