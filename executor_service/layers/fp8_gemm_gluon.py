"""The W8A8 block-scaled GEMM in Gluon (Hopper): each K step's product scaled while the next steps'
wgmmas run, for fp8_gemm_triton's configurations with `KERNEL: "gluon"`.

The GEMM is fp8_gemm_triton's: y = x @ W^T, x e4m3 [M, K] with one fp32 scale per token and 128
columns, W e4m3 [N, K] with one per 128 x 128 block, so each K step of 128 has its own scale per
row (a_s * b_s, b_s one scalar when BLOCK_N divides 128): acc = fma(dot_k, scale_k, acc) in fp32,
the v2 kernel's arithmetic in the v2 kernel's order.

Triton's tl.dot waits for each K step's wgmma before the FFMAs that scale it, so a warpgroup's
tensor-core work and its scaling alternate (other programs on the SM fill the gaps). Here the
kernel issues wgmma itself: PRODUCTS K steps an iteration (2, or 4) are started into fresh
registers (use_acc=False, asynchronously), then each is waited for with the ones after it still
outstanding and scaled while they multiply. What ptxas needs for that (`python
bench/fp8_gemm_gluon.py --sass` shows the loop: `wgmma x8, wait(1 outstanding), FFMA x64, wait(0
outstanding), FFMA x64` at 64 x 128, 4 warps, two products):

- no product in flight across the loop's back edge: carried in flight, its phi copies read the
  registers early and ptxas serializes every wgmma of the kernel (its note C7514);
- the scales loaded at the top of the iteration: loaded after the first wait (behind the refill's
  barriers) they hold every FFMA until after the last wait;
- registers for the sum and the products (3 x 64 fp32 a thread for two at 64 x 128 a warpgroup,
  5 x 32 for four at 64 x 64); at 16 warps (128 registers a thread) 256 x 128 tiles, or four
  products, serialize (C7512).

Operands come through TMA into a ring of NUM_STAGES shared-memory slots (at least PRODUCTS), one
mbarrier a slot, all filled before the loop; a slot is refilled with the step NUM_STAGES after the
one it held once that step's wgmma is complete. The K steps left over (fewer than PRODUCTS) run one
by one. The tile is stored from the wgmma's register layout, or with SPLIT_K > 1 added to an fp32
output atomically, as the Triton kernels do.

wgmma is sm90's alone (fp8_gemm_triton.gluon_applies); elsewhere, and under the interpreter (Gluon
has none), fp8_gemm_triton runs the v2 kernel with the same tiles: the same sums in the same order.

Measured on the H200 (bench/RESULTS.md, 2026-12-05): equal to v2 to the bit without split-K, and
no faster from 256 tokens on (qkv 23.3 against 23.2 us; 4-10% slower at 2,048), so the waits for
each K step's wgmma are not what bounds these GEMMs (other programs on the SM fill those gaps); at
1-32 tokens its 64 x 64 tiles beat the first kernel's split-K rule by 0-2.5 us.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

GROUP = 128  # the scale block along K and N


@triton.constexpr_function
def mma_warps(block_m, num_warps):
    """warps_per_cta of the wgmma layout: warpgroups stacked along M while they have 64 rows each,
    then side by side along N."""
    along_m = min(num_warps, max(4, block_m // 16))
    return [along_m, num_warps // along_m]


@triton.constexpr_function
def mma_instr_n(block_m, block_n, num_warps):
    """The wgmma instruction's N: the widest multiple of 8 (at most 256) dividing each warpgroup's
    share of the tile's columns."""
    share = block_n // mma_warps(block_m, num_warps)[1]
    n = min(256, share)
    while share % n:
        n -= 8
    return n


@gluon.jit
def _load_step(a_desc, b_desc, a_bufs, b_bufs, bars, kb, slot, off_m, off_n, pred):
    """TMA loads of K step kb's operand tiles into ring slot `slot` (when pred)."""
    bar = bars.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(
        a_desc, [off_m, kb * a_desc.block_type.shape[1]], bar, a_bufs.index(slot), pred=pred
    )
    tma.async_copy_global_to_shared(
        b_desc, [off_n, kb * b_desc.block_type.shape[1]], bar, b_bufs.index(slot), pred=pred
    )


@gluon.jit
def _start_step(a_bufs, b_bufs, zero, slot):
    """The wgmma of the step in ring slot `slot`, into fresh registers, left in flight."""
    return warpgroup_mma(
        a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True
    )


@gluon.jit
def _step_scale(a_s_ptrs, m_mask, b_s_ptr, kb):
    """K step kb's scale of each row: the activation's times the weight block's."""
    return gl.load(a_s_ptrs + kb, mask=m_mask, other=0.0) * gl.load(b_s_ptr + kb)


@gluon.jit
def _finish_step(done, scale, acc, a_desc, b_desc, a_bufs, b_bufs, bars, kb_lo, step, steps, off_m, off_n,
                 NUM_STAGES: gl.constexpr):  # fmt: skip
    """Step `step`'s product, complete: its slot refilled with the step NUM_STAGES on, and the
    product scaled into acc."""
    ahead = step + NUM_STAGES
    _load_step(
        a_desc, b_desc, a_bufs, b_bufs, bars, kb_lo + ahead, step % NUM_STAGES, off_m, off_n, ahead < steps
    )
    return gl.fma(done, gl.expand_dims(scale, 1), acc)


@gluon.jit
def w8a8_block_matmul_gluon_kernel(
    a_desc,  # [M, K] e4m3, boxes [BLOCK_M, 128]
    b_desc,  # [N, K] e4m3, boxes [BLOCK_N, 128]
    c_ptr,  # [M, N]: the output dtype, or fp32 (zeroed) with SPLIT_K > 1
    a_s_ptr,  # [M, K / 128] fp32
    b_s_ptr,  # [N / 128, K / 128] fp32
    M,
    N,
    K,
    stride_cm,
    stride_asm,
    stride_bsn,
    SPLIT_K: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    PRODUCTS: gl.constexpr,  # K steps a loop iteration, their wgmmas in flight together
    num_warps: gl.constexpr,
):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    gl.static_assert(BLOCK_K == 128, "one activation scale a row and K step")
    gl.static_assert(128 % BLOCK_N == 0, "one weight scale a tile and K step")
    gl.static_assert(
        NUM_STAGES >= PRODUCTS, "a step's load waits for the step NUM_STAGES before it to finish"
    )

    # The tile, in fp8_gemm_triton's grouped order, and this split's K steps [kb_lo, kb_hi).
    pid = gl.program_id(0)
    num_m = gl.cdiv(M, BLOCK_M)
    num_n = gl.cdiv(N, BLOCK_N)
    first_m = pid // (GROUP_M * num_n) * GROUP_M
    size_m = gl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    num_kb = gl.cdiv(K, BLOCK_K)
    per_split = gl.cdiv(num_kb, SPLIT_K)
    kb_lo = gl.program_id(1) * per_split
    kb_hi = gl.minimum(kb_lo + per_split, num_kb)
    steps = kb_hi - kb_lo

    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0],
        warps_per_cta=mma_warps(BLOCK_M, num_warps),
        instr_shape=[16, mma_instr_n(BLOCK_M, BLOCK_N, num_warps), 32],
    )
    rows: gl.constexpr = gl.SliceLayout(1, layout)
    cols: gl.constexpr = gl.SliceLayout(0, layout)
    rm = off_m + gl.arange(0, BLOCK_M, layout=rows)
    m_mask = rm < M
    a_s_ptrs = a_s_ptr + rm.to(gl.int64) * stride_asm
    b_s_ptr += (off_n // 128).to(gl.int64) * stride_bsn

    if steps > 0:
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NUM_STAGES):
            mbarrier.init(bars.index(s), count=1)
        fence_async_shared()
        for s in gl.static_range(NUM_STAGES):
            _load_step(a_desc, b_desc, a_bufs, b_bufs, bars, kb_lo + s, s, off_m, off_n, s < steps)

        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        # PRODUCTS K steps an iteration: all their products started, then each waited for with the
        # ones after it still outstanding and scaled while they multiply. No wgmma is in flight
        # across iterations: a product carried in flight through the loop's back edge is copied
        # there, which ptxas answers by serializing every wgmma (its C7514 note).
        for j in range(0, steps // PRODUCTS):
            i = PRODUCTS * j
            # The scales first: their loads' latency passes while the wgmmas run.
            scales = ()
            for u in gl.static_range(PRODUCTS):
                scales = scales + (_step_scale(a_s_ptrs, m_mask, b_s_ptr, kb_lo + i + u),)
            products = ()
            for u in gl.static_range(PRODUCTS):
                mbarrier.wait(bars.index((i + u) % NUM_STAGES), ((i + u) // NUM_STAGES) & 1)
                products = products + (_start_step(a_bufs, b_bufs, zero, (i + u) % NUM_STAGES),)
            for u in gl.static_range(PRODUCTS):
                # acc passes through each wait, so that the FFMAs before it stay there.
                done, acc = warpgroup_mma_wait(num_outstanding=PRODUCTS - 1 - u, deps=(products[u], acc))
                acc = _finish_step(done, scales[u], acc, a_desc, b_desc, a_bufs, b_bufs, bars, kb_lo, i + u, steps,
                                   off_m, off_n, NUM_STAGES)  # fmt: skip
        for i in range(steps - steps % PRODUCTS, steps):  # the last steps one by one
            scale = _step_scale(a_s_ptrs, m_mask, b_s_ptr, kb_lo + i)
            mbarrier.wait(bars.index(i % NUM_STAGES), (i // NUM_STAGES) & 1)
            last = _start_step(a_bufs, b_bufs, zero, i % NUM_STAGES)
            done = warpgroup_mma_wait(num_outstanding=0, deps=(last,))
            acc = _finish_step(done, scale, acc, a_desc, b_desc, a_bufs, b_bufs, bars, kb_lo, i, steps, off_m, off_n,
                               NUM_STAGES)  # fmt: skip
        for s in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(bars.index(s))

        rn = off_n + gl.arange(0, BLOCK_N, layout=cols)
        c_ptrs = c_ptr + gl.expand_dims(rm.to(gl.int64) * stride_cm, 1) + gl.expand_dims(rn, 0)
        mask = gl.expand_dims(m_mask, 1) & gl.expand_dims(rn < N, 0)
        if SPLIT_K == 1:
            gl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
        else:
            gl.atomic_add(c_ptrs, acc, mask=mask, sem="relaxed")


def operand_layout(rows: int) -> gl.NVMMASharedLayout:
    """The shared-memory layout (128-byte swizzle) of an e4m3 [rows, 128] operand box."""
    return gl.NVMMASharedLayout.get_default_for([rows, GROUP], gl.float8e4nv)


def launch_gluon(a_q, a_s, weight, weight_scale_inv, c, cfg: dict, grid: tuple[int, int]) -> None:
    """w8a8_block_matmul_gluon_kernel with cfg's tiles (BLOCK_M a multiple of 64, BLOCK_N dividing
    128), stages, warps and split into c; the operands must suit TMA (fp8_gemm_triton.tma_applies)."""
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if block_m % 64 or GROUP % block_n or block_n % 8:
        raise ValueError(f"the Gluon GEMM takes BLOCK_M a multiple of 64 and BLOCK_N dividing {GROUP}, not "
                         f"{block_m} x {block_n}")  # fmt: skip
    a_desc = TensorDescriptor.from_tensor(a_q, [block_m, GROUP], operand_layout(block_m))
    b_desc = TensorDescriptor.from_tensor(weight, [block_n, GROUP], operand_layout(block_n))
    m, k = a_q.shape
    n = weight.shape[0]
    w8a8_block_matmul_gluon_kernel[grid](
        a_desc, b_desc, c, a_s, weight_scale_inv, m, n, k,
        c.stride(0), a_s.stride(0), weight_scale_inv.stride(0),
        SPLIT_K=cfg.get("SPLIT_K", 1), NUM_STAGES=cfg["num_stages"], GROUP_M=cfg.get("GROUP_M", 8),
        PRODUCTS=cfg.get("PRODUCTS", 2),
        num_warps=cfg["num_warps"],
    )  # fmt: skip
