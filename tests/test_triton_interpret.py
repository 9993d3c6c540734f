"""The Triton kernels' logic on the CPU: small shapes under TRITON_INTERPRET=1, in a subprocess (the
variable must be set before triton is imported), against torch_ref. Skipped where triton is missing.

The interpreter computes tl.dot on bfloat16 as raw integers (it stores bf16 as uint16), so the
attention checks run in float16; bf16 is covered by the store check and by the GPU tests."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers.interpret import PRELUDE, ROOT

# Starts service processes or runs models at length: left out of `make test-fast`.
pytestmark = pytest.mark.slow

pytest.importorskip("triton")


CASES = {
    "store": """
for dtype in (torch.bfloat16, f16):
    for block_size in (16, 256):
        check_store(make_batch([3, 1, 5, 40], [20, 1, 40, 300], 4, 2, 32, block_size, dtype, "cpu", num_padding=2))
""",
    "decode": """
for group, block_size in ((1, 16), (2, 256), (4, 16), (8, 16)):
    for splits in (1, 3):
        b = make_batch([1] * 4, [20, 1, 40, 17], 2 * group, 2, 32, block_size, f16, "cpu", num_padding=2)
        check_decode(b, splits)
# head_dim 48: padded to 64 lanes, masked
check_decode(make_batch([1] * 3, [20, 33, 5], 4, 2, 48, 16, f16, "cpu", num_padding=1), 2)
check_prefill(make_batch([9, 1, 20], [30, 9, 20], 4, 2, 48, 16, f16, "cpu", seed=4))
""",
    "decode_padding_only": """
b = make_batch([], [], 4, 2, 32, 16, f16, "cpu", num_padding=3)
for splits in (1, 2):
    check_decode(b, splits)
""",
    "prefill": """
# Prefix hits and later chunks (query length < context length), with and without a partial tile.
for group, block_size, cfg in ((2, 16, None), (8, 16, {"BLOCK_M": 16, "BLOCK_N": 16}), (1, 256, {"BLOCK_M": 16})):
    b = make_batch([7, 40, 16], [30, 40, 48], 2 * group, 2, 32, block_size, f16, "cpu", seed=group)
    check_prefill(b, config=cfg)
""",
    "fp8_kv": """
import itertools
# e4m3 caches: the store byte-exact (large values saturate, tiny ones are subnormal), then decode,
# prefill after a prefix and mixed steps, with unit and non-unit scales.
for dtype in (torch.bfloat16, f16):
    b = make_batch([3, 1, 5, 40], [20, 1, 40, 300], 4, 2, 32, 16, dtype, "cpu", num_padding=2)
    b["k"].mul_(300.0)
    b["v"].mul_(0.001)
    check_store_fp8(to_fp8(b, 1.0, 1.0))
    check_store_fp8(to_fp8(make_batch([7, 2], [7, 30], 4, 2, 48, 16, dtype, "cpu"), 0.02, 3.0))
    # A decode step with tokens at their blocks' first slots (whole rows of V^T and zeros).
    check_store_fp8(to_fp8(make_batch([1] * 4, [17, 33, 20, 1], 4, 2, 32, 16, dtype, "cpu", num_padding=1), 0.02, 3.0))
    # A block size that is no power of 2: the zeroing stays inside the block.
    check_store_fp8(to_fp8(make_batch([13, 2], [13, 30], 4, 2, 32, 12, dtype, "cpu", seed=5), 0.02, 3.0))
for scales in ((1.0, 1.0), (0.05, 2.5)):
    for splits, f16_dot in itertools.product((1, 3), (False, True)):
        cfg = {"FP8_DOT_F16": f16_dot, "BLOCK_N": 16}
        check_attention_fp8(to_fp8(make_batch([1] * 4, [20, 1, 40, 17], 8, 2, 32, 16, f16, "cpu", num_padding=2), *scales), splits, decode_config=cfg)
    # GQA groups of 2 and 4 query heads, alone and beside prefill rows.
    for splits, group in itertools.product((1, 3), (2, 4)):
        b = make_batch([1] * 4, [20, 1, 40, 17], 2 * group, 2, 32, 16, f16, "cpu", num_padding=2)
        check_attention_fp8(to_fp8(b, *scales), splits, decode_config={"BLOCK_N": 16})
    b = make_batch([5, 1, 33, 1], [21, 9, 50, 70], 4, 2, 48, 16, f16, "cpu", seed=3, num_padding=1)
    check_attention_fp8(to_fp8(b, *scales), 2, decode_config={"BLOCK_N": 16})

    b = make_batch([5, 20, 1, 33, 1], [21, 20, 9, 50, 70], 4, 2, 32, 16, f16, "cpu", seed=1, num_padding=1)
    check_attention_fp8(to_fp8(b, *scales), 2)
    # Key tiles of several cache blocks (V^T loaded a block at a time), decode and prefill.
    for block_size in (4, 8):
        b = make_batch([1, 1, 3, 1], [13, 1, 40, 27], 4, 2, 32, block_size, f16, "cpu", seed=4, num_padding=1)
        check_attention_fp8(to_fp8(b, *scales), 2, decode_config={"BLOCK_N": 32}, config={"BLOCK_N": 16})
    check_attention_fp8(to_fp8(make_batch([7, 40], [30, 48], 4, 2, 32, 16, f16, "cpu", seed=2), *scales), config={"BLOCK_M": 16})
    # Blocks of 64 slots, V^T read in runs of 16: contexts ending inside a run, at its end, past it.
    b = make_batch([1] * 5, [20, 1, 40, 100, 48], 4, 2, 32, 64, f16, "cpu", seed=6, num_padding=1)
    check_attention_fp8(to_fp8(b, *scales), 2, decode_config={"BLOCK_N": 32})
""",
    "fp8_mma": """
from helpers.fp8_mma_checks import check_decode_fp8_mma
# Decode in e4m3 MMAs (FP8_MMA; head_dim 64 at least) against the torch model of its arithmetic and exact attention: GQA
# groups 1-8, split over the keys or not, key tiles of one cache block and of several, blocks of
# 64 slots (V^T in runs of 16), unit and other scales, fp16 and bf16 queries.
for dtype, scales in ((f16, (1.0, 1.0)), (torch.bfloat16, (0.05, 2.5))):
    for group, splits in ((1, 1), (2, 3), (4, 1), (8, 3)):
        b = make_batch([1] * 4, [20, 1, 40, 17], 2 * group, 2, 64, 16, dtype, "cpu", num_padding=2, seed=group)
        check_decode_fp8_mma(to_fp8(b, *scales), splits, {"BLOCK_N": 16})
    for block_size, block_n in ((8, 32), (64, 32)):
        b = make_batch([1] * 5, [20, 1, 40, 100, 48], 4, 2, 64, block_size, dtype, "cpu", seed=6, num_padding=1)
        check_decode_fp8_mma(to_fp8(b, *scales), 2, {"BLOCK_N": block_n})
    # FULL_TILES: the tiles within the context unmasked, then the last one (contexts of whole tiles,
    # 16 and 48, have no last partial tile; splits of several tiles and of none).
    for splits in (1, 2, 5):
        b = make_batch([1] * 6, [20, 1, 40, 16, 48, 100], 4, 2, 64, 8, dtype, "cpu", seed=7, num_padding=1)
        check_decode_fp8_mma(to_fp8(b, *scales), splits, {"BLOCK_N": 16, "FULL_TILES": True})
""",
    "fp8_mma_tma": """
from helpers.fp8_mma_checks import check_tma_kv
from helpers.attention_fp8_checks import check_decode_stores_kv
# FP8_MMA's tiles through TMA descriptors (TMA_KV), a box a tile: a tile a block (16 / 16) and
# several tiles a block (64 / 16 and 64 / 32: boxes at slot offsets), contexts ending mid-tile, at a
# block's end and past it, KV heads 2, split over the keys or not, fp16 and bf16 queries.
for dtype, (block_size, block_n), splits in (
    (f16, (16, 16), 1), (torch.bfloat16, (16, 16), 3), (f16, (64, 16), 2), (torch.bfloat16, (64, 32), 1),
):
    b = make_batch([1] * 5, [20, 1, 64, 100, 48], 4, 2, 64, block_size, dtype, "cpu", seed=6, num_padding=1)
    check_tma_kv(to_fp8(b, 0.05, 2.5), splits, {"BLOCK_N": block_n})
# ... with FULL_TILES (the last tile by pointer loads), and storing the step's K and V first (the
# proxy fence's path)
for splits in (1, 2):
    b = make_batch([1] * 5, [20, 1, 40, 16, 100], 4, 2, 64, 64, f16, "cpu", seed=7, num_padding=1)
    check_tma_kv(to_fp8(b, 1.0, 1.0), splits, {"BLOCK_N": 16, "FULL_TILES": True})
b = make_batch([1] * 5, [17, 33, 20, 1, 40], 4, 2, 64, 16, f16, "cpu", num_padding=2)
check_decode_stores_kv(to_fp8(b, 0.05, 2.5), 3, {"BLOCK_N": 16, "FP8_MMA": True, "TMA_KV": True})
# ... and the widening loop's tiles through TMA (K and V widened to fp16 after the copy), alone and
# storing the step's K and V first
for splits in (1, 3):
    b = make_batch([1] * 5, [20, 1, 64, 100, 48], 4, 2, 64, 64, f16, "cpu", seed=8, num_padding=1)
    check_tma_kv(to_fp8(b, 0.05, 2.5), splits, {"FP8_MMA": False, "BLOCK_N": 32})
b = make_batch([1] * 5, [17, 33, 20, 1, 40], 4, 2, 64, 16, f16, "cpu", num_padding=2)
check_decode_stores_kv(to_fp8(b, 0.05, 2.5), 3, {"BLOCK_N": 16, "FP8_MMA": False, "TMA_KV": True})
""",
    "fp8_decode_new_key": """
from helpers.attention_fp8_checks import check_decode_fuses_rope, check_decode_new_key_regs
# The decode kernel attending to the step's key from registers (DECODE_NEW_KEY_REGS): contexts of
# 1-3 tokens (the new key most of the weight), tokens at a block's first slot (17, 33, 65) and
# mid-block, key tiles of one and of several blocks, split over the keys or not; the widening loop,
# FP8_MMA and FP8_MMA's FULL_TILES; fp16 and bf16 queries.
ctx = [2, 17, 33, 20, 1, 40, 3, 65]
for dtype, block_size, tile, splits in (
    (f16, 16, {"BLOCK_N": 16, "FP8_MMA": False}, 1), (torch.bfloat16, 8, {"BLOCK_N": 32, "FP8_MMA": False}, 3),
    (f16, 8, {"BLOCK_N": 16, "FP8_MMA": True}, 3), (torch.bfloat16, 16, {"BLOCK_N": 16, "FP8_MMA": True}, 1),
    (f16, 32, {"BLOCK_N": 16, "FP8_MMA": True, "FULL_TILES": True}, 2),
):
    b = make_batch([1] * len(ctx), ctx, 4, 2, 64, block_size, dtype, "cpu", seed=4, num_padding=2)
    check_decode_new_key_regs(to_fp8(b, 0.05, 2.5), splits, tile)
# ... normalising and rotating q and the new K itself (DECODE_FUSES_ROPE), with and without q/k norms.
for dtype, with_norm, tile in ((f16, True, {"BLOCK_N": 16, "FP8_MMA": False}), (torch.bfloat16, False, {"BLOCK_N": 16, "FP8_MMA": True})):
    b = make_batch([1] * 5, [17, 2, 20, 1, 40], 4, 2, 64, 16, dtype, "cpu", seed=5, num_padding=2)
    check_decode_fuses_rope(to_fp8(b, 0.05, 2.5), 3, tile, with_norm=with_norm, exact=not with_norm, new_key_regs=True)
""",
    "fp8_decode_stores_kv": """
from helpers.attention_fp8_checks import check_decode_stores_kv
# Decode tokens at a block's first slot (17, 33, 1: whole rows and zeros) and mid-block (20, 40),
# padding rows, key tiles of one and of several blocks, split over the keys or not.
for block_size, block_n in ((16, 16), (8, 32)):
    for splits in (1, 3):
        b = make_batch([1] * 5, [17, 33, 20, 1, 40], 4, 2, 32, block_size, f16, "cpu", num_padding=2)
        check_decode_stores_kv(to_fp8(b, 0.05, 2.5), splits, {"BLOCK_N": block_n})
# ... and with the loop in e4m3 MMAs (FP8_MMA)
b = make_batch([1] * 5, [17, 33, 20, 1, 40], 4, 2, 64, 8, f16, "cpu", num_padding=2)
check_decode_stores_kv(to_fp8(b, 0.05, 2.5), 3, {"BLOCK_N": 16, "FP8_MMA": True})
# A cache block of several key tiles (BLOCK_N below the block size), split among up to 8 programs.
b = make_batch([1] * 4, [65, 100, 129, 7], 4, 2, 32, 64, f16, "cpu", seed=2, num_padding=1)
for splits in (1, 3, 8):
    check_decode_stores_kv(to_fp8(b, 1.0, 1.0), splits, {"BLOCK_N": 16})
from helpers.attention_fp8_checks import check_decode_fuses_rope
# ... and normalising and rotating q and the new K itself (DECODE_FUSES_ROPE), with and without q/k norms.
for dtype, with_norm in ((f16, True), (torch.bfloat16, True), (f16, False)):
    b = make_batch([1] * 5, [17, 33, 20, 1, 40], 4, 2, 32, 16, dtype, "cpu", seed=5, num_padding=2)
    check_decode_fuses_rope(to_fp8(b, 0.05, 2.5), 3, {"BLOCK_N": 16}, with_norm=with_norm)
b = make_batch([1] * 5, [17, 33, 20, 1, 40], 4, 2, 64, 16, torch.bfloat16, "cpu", seed=5, num_padding=2)
check_decode_fuses_rope(to_fp8(b, 0.05, 2.5), 3, {"BLOCK_N": 16, "FP8_MMA": True}, with_norm=True)
# Through the attention layer: Qwen3 (q/k norms), families without them, YaRN and llama3 rotary tables,
# GROUP 1 to 4, head_dim 32 and 64, positions up to 4,999.
from helpers.attention_fp8_checks import check_layer_fuses_rope
yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024}
llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 1024}
check_layer_fuses_rope(True, {}, 4, 2, 32, [17, 33, 1, 300], f16)
check_layer_fuses_rope(False, {}, 8, 2, 64, [17, 2000, 1, 40], f16)
check_layer_fuses_rope(False, yarn, 4, 2, 32, [1500, 3, 64], f16)
check_layer_fuses_rope(True, llama3, 4, 4, 32, [5000, 3, 64], torch.float32)
""",
    "fp8_gemm": """
from helpers.fp8_gemm_checks import check_gemm, check_quantize
for dtype in (torch.bfloat16, f16):
    check_quantize(5, 300, dtype, "cpu")  # a partial group
    check_quantize(3, 256, dtype, "cpu")
small = {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
check_gemm(5, 72, 256, torch.float32, "cpu", small)  # partial N tile, two K steps
check_gemm(17, 160, 384, torch.float32, "cpu", small)  # partial M tile, N scale blocks of 128
check_gemm(17, 160, 384, torch.float32, "cpu", {**small, "SPLIT_K": 2})  # K in two shares of 1 and 2 steps
check_gemm(5, 72, 256, torch.float32, "cpu", {**small, "SPLIT_K": 4})  # more shares than steps: empty ones
# ... summed in the kernel by each tile's last split (SUM_IN_KERNEL), v1 and v2 (pointer loads)
from helpers.fp8_gemm_checks import check_split_k_in_kernel
check_split_k_in_kernel(17, 160, 384, torch.float32, "cpu", {**small, "SPLIT_K": 2})
check_split_k_in_kernel(5, 72, 256, torch.bfloat16, "cpu", {**small, "SPLIT_K": 4})
check_split_k_in_kernel(17, 160, 384, torch.bfloat16, "cpu", {**small, "KERNEL": "v2", "TMA": False, "SPLIT_K": 3})
from helpers.fp8_gemm_checks import check_fp8_linear_layers
check_fp8_linear_layers("cpu")
from helpers.fp8_gemm_checks import check_fp8_linear_quantized_input
assert check_fp8_linear_quantized_input(5, 72, 256, torch.float32, "cpu") == 1
""",
    "fused_ops": """
from helpers.triton_op_checks import check_qk_norm_rope, check_rms_norm, check_silu_and_mul
for dtype in (torch.float32, torch.bfloat16, f16):
    check_rms_norm(5, 96, dtype, "cpu")
    check_silu_and_mul(3, 200, dtype, "cpu")
    check_qk_norm_rope(4, 4, 2, 32, dtype, "cpu")
    check_qk_norm_rope(3, 2, 1, 64, dtype, "cpu")
    check_qk_norm_rope(3, 6, 2, 32, dtype, "cpu")  # head counts no power of 2
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024}
    check_qk_norm_rope(5, 4, 2, 32, dtype, "cpu", with_norm=False, rope=yarn)
from helpers.triton_op_checks import check_qk_norm_rope_stores_kv
FP8 = torch.float8_e4m3fn
for kv_dtype, block_size, scales in ((torch.bfloat16, 16, (1.0, 1.0)), (FP8, 16, (0.02, 3.0)), (FP8, 8, (1.0, 1.0)), (FP8, 12, (1.0, 1.0))):
    check_qk_norm_rope_stores_kv(2, 32, torch.bfloat16, kv_dtype, block_size, "cpu", scales)
check_qk_norm_rope_stores_kv(1, 64, f16, FP8, 16, "cpu", (1.0, 2.5), with_norm=False)
check_qk_norm_rope_stores_kv(3, 32, f16, FP8, 8, "cpu", (1.0, 1.0))  # 3 KV heads
from helpers.triton_op_checks import check_fused_quantization
for dtype in (torch.float32, torch.bfloat16, f16):
    check_fused_quantization(5, 384, dtype, "cpu")  # 3 groups: a partial power-of-2 block
check_fused_quantization(3, 1536, torch.bfloat16, "cpu")  # silu_and_mul in two programs of 1024
""",
    "fp8_v_tiles": """
# The e4m3 V store of a long launch (store_v_tiles_kernel, V_TILE rows a program), forced for
# every launch: the same bytes as the per-token store, in the attention store and the fused
# rotary kernel's, across tiles, blocks, padding rows and block sizes no power of 2.
from executor_service.attention import triton_kernels
from executor_service.layers import triton_ops
from helpers.triton_op_checks import check_qk_norm_rope_stores_kv
triton_kernels.V_TILE_MIN_TOKENS = 0
tiles = []  # each store_v_tiles launch (a spy: the checks below must run it, not the per-token store)
def spy(v, *args, store=triton_kernels.store_v_tiles):
    tiles.append(v.shape[0])
    return store(v, *args)
triton_kernels.store_v_tiles = triton_ops.store_v_tiles = spy
for dtype in (torch.bfloat16, f16):
    check_store_fp8(to_fp8(make_batch([3, 1, 5, 40], [20, 1, 40, 300], 4, 2, 32, 16, dtype, "cpu", num_padding=2), 0.02, 3.0))
    check_store_fp8(to_fp8(make_batch([1] * 4, [17, 33, 20, 1], 4, 2, 32, 16, dtype, "cpu", num_padding=1), 1.0, 1.0))
    check_store_fp8(to_fp8(make_batch([13, 70], [13, 90], 4, 2, 32, 12, dtype, "cpu", seed=5), 0.02, 3.0))
FP8 = torch.float8_e4m3fn
for block_size, scales in ((16, (0.02, 3.0)), (8, (1.0, 1.0)), (12, (1.0, 1.0))):
    check_qk_norm_rope_stores_kv(2, 32, torch.bfloat16, FP8, block_size, "cpu", scales)
check_qk_norm_rope_stores_kv(3, 32, f16, FP8, 8, "cpu", (1.0, 1.0))
assert len(tiles) == 10, tiles  # 6 attention stores, 4 fused rotary ones
""",
    "sampling": """
from helpers.sampling_checks import (
    check_distribution, check_greedy, check_logit_bias_and_min_tokens, check_sampler_routing, check_seed_isolation
)
check_sampler_routing("cpu")
check_logit_bias_and_min_tokens("cpu", fused=True)
check_greedy(5, 40, torch.float32, "cpu", block=16)  # 3 tiles, the last one partial
check_greedy(3, 40, f16, "cpu", block=16)
check_seed_isolation(24, "cpu", block=16)
# 400 draws: a frequency's standard error is at most 0.025; 0.1 is 4 of them.
check_distribution(400, 6, 0.6, "cpu", block=8, tol=0.1)
""",
    "fused_moe": """
from helpers.fused_moe_checks import LOADS, check_fused_moe
from executor_service.layers.fused_moe_triton import MoEConfig
small = MoEConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1)  # several N and K tiles
for num_tokens, used in LOADS:
    for dtype in (torch.float32, f16):
        check_fused_moe(num_tokens, 8, 2, 64, 48, dtype, "cpu", used=used)
    check_fused_moe(num_tokens, 8, 2, 40, 24, torch.float32, "cpu", used=used, config=small)
check_fused_moe(9, 4, 4, 32, 32, torch.float32, "cpu", config=MoEConfig(32, 32, 32, 4, 1))  # top_k = experts
""",
    "fused_moe_fp8": """
from helpers.fused_moe_checks import check_fused_moe_fp8
from executor_service.layers.fused_moe_triton import MoEConfig
small = (MoEConfig(16, 32, 128, 4, 1), MoEConfig(16, 64, 128, 4, 1))  # N tiles within a scale block
for num_tokens, used in ((1, None), (5, 3), (33, 1), (40, None)):
    for dtype in (torch.float32, f16):
        # partial K and N blocks (hidden 200, N 48: one scale block each, up's right after gate's),
        # then two whole blocks of each (several N tiles per block, two K steps)
        check_fused_moe_fp8(num_tokens, 8, 2, 200, 48, dtype, "cpu", used=used, config=small)
        check_fused_moe_fp8(num_tokens, 4, 2, 256, 256, dtype, "cpu", used=used, config=small)
check_fused_moe_fp8(9, 4, 4, 128, 128, torch.float32, "cpu")  # top_k = experts, CONFIGS' tiles
from helpers.fused_moe_checks import check_fp8_moe_layer
check_fp8_moe_layer("cpu")
""",
    "fp8_mma_tile": """
# FP8_MMA takes its own tile (FP8_MMA_TILE) where it applies and the widening loop keeps
# DECODE_CONFIG_FP8's; a config passed in names its own. The kernel's launches, as the spy sees them.
from executor_service.attention import triton_kernels as tk
from helpers.fp8_mma_checks import decode_kernel_launches

def launch(head_dim, config=None):
    b = to_fp8(make_batch([1, 1], [20, 40], 4, 2, head_dim, 16, f16, "cpu", seed=3), 0.05, 2.5)
    ctx = b["context"]
    with decode_kernel_launches() as launches:
        tk.paged_decode(
            b["q"], b["k_cache"], b["v_cache"], torch.empty_like(b["q"]), ctx.block_tables, ctx.context_lens,
            ctx.cu_seqlens_q, b["scale"], config=config, kv_scales=b["kv_scales"],
        )
    (kw,) = launches
    return kw.get("FP8_MMA", False), kw["BLOCK_N"], kw["num_stages"]

tk.DECODE_CONFIG_FP8.update(FP8_MMA=True, BLOCK_N=32, num_stages=3)
tk.FP8_MMA_TILE.update(BLOCK_N=16, num_stages=2)
assert launch(64) == (True, 16, 2), launch(64)
assert launch(32) == (False, 32, 3), launch(32)  # head_dim 32: FP8_MMA does not apply
assert launch(64, {"BLOCK_N": 64, "num_stages": 1}) == (True, 64, 1)
tk.DECODE_CONFIG_FP8["FP8_MMA"] = False
assert launch(64) == (False, 32, 3), launch(64)
""",
    "mixed": """
# Prefill chunks and decode rows in one step, plus CUDA-graph padding rows.
for splits in (1, 3):
    b = make_batch([5, 20, 1, 33, 1], [21, 20, 9, 50, 70], 4, 2, 32, 16, f16, "cpu", seed=1, num_padding=1)
    check_prefill(b, splits)
""",
}


def _interpret(*args: str) -> subprocess.CompletedProcess:
    """python args under TRITON_INTERPRET=1 in the repository root; it must exit 0."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_under_interpreter(case):
    _interpret("-c", PRELUDE + CASES[case])


def test_kv_read_roofline_reads_every_byte_of_each_context():
    """bench/kv_read_roofline.py's kernel (the fp8 decode kernel's K/V gather alone, the ceiling its
    TB/s is read against) XORs exactly the bytes of each sequence's keys, K and V^T, at block sizes
    below, equal to and above its tile's words: a gather that skipped or repeated a block would not
    give torch's XOR; and so does its TMA form (boxes of 64 and 128 keys in blocks of 128), the
    ceiling of the decode config's TMA_KV."""
    args = ["--check-only", "--block-sizes", "16", "32", "128", "--batch", "3", "--context", "256"]
    result = _interpret("bench/kv_read_roofline.py", *args)
    assert result.stdout.count("the kernel's XOR of every byte is torch's") == 5, result.stdout
    assert result.stdout.count("TMA boxes of") == 2, result.stdout


def test_fused_ops_bench_launch_shapes_keep_the_outputs():
    """bench/fused_ops.py's launch shapes (triton_ops.RMS_NORM_WARPS, SILU_AND_MUL_TILES): SiLU-and-mul
    in programs of 512-4,096 columns (three, two or one a row of 1,536) gives the default launch's
    bytes and scales, quantized or not (a program that skipped or misplaced a group of 128 would
    not). RMSNorm's warps run the same under the interpreter (it ignores num_warps): its rows are
    checked, its reduction order only on the GPU."""
    result = _interpret("bench/fused_ops.py", "--check-only", "--widths", "256,1536", "--tokens", "3,5")
    assert result.stdout.count("checked at [3, 5] tokens") == 4, result.stdout
    assert "every launch shape checked against the default launch" in result.stdout


def test_a_silu_and_mul_tile_must_be_whole_groups():
    """A SILU_AND_MUL_TILES entry of a program width no power of 2 or under a group of 128 is refused
    naming the entry, not launched into misplaced groups."""
    from executor_service.layers import triton_ops

    for bad in ((96, 4), (384, 4)):
        triton_ops.SILU_AND_MUL_TILES[3072] = bad
        try:
            with pytest.raises(ValueError, match=r"SILU_AND_MUL_TILES\[3072\]"):
                triton_ops.silu_and_mul_tile(3072)
        finally:
            triton_ops.SILU_AND_MUL_TILES.pop(3072)
    assert triton_ops.silu_and_mul_tile(3072) == (1024, 4)
    assert triton_ops.silu_and_mul_tile(200) == (256, 4)
