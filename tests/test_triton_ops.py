"""The fused Triton ops (executor_service/layers/triton_ops.py) against the PyTorch layers they
replace, on the GPU. Outputs are compared exactly in fp32 up to reduction order, and in bf16/fp16
within one rounding step of the model dtype.

The `check_*` helpers are also driven on the CPU under TRITON_INTERPRET=1 by
test_triton_interpret.py."""

from __future__ import annotations

import pytest
import torch
from helpers.triton_op_checks import (
    check_fused_quantization,
    check_qk_norm_rope,
    check_qk_norm_rope_stores_kv,
    check_rms_norm,
    check_silu_and_mul,
)

# Triton's CPU interpreter truncates fp32 -> bf16 instead of rounding to nearest, so there bf16 results
# are only checked for closeness.


pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, hidden", [(1, 1024), (7, 1000), (256, 4096), (3000, 1024)])
def test_rms_norm(num_tokens, hidden, dtype):
    check_rms_norm(num_tokens, hidden, dtype, "cuda")


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, size", [(1, 3072), (5, 100), (256, 12288), (2048, 3072)])
def test_silu_and_mul(num_tokens, size, dtype):
    check_silu_and_mul(num_tokens, size, dtype, "cuda")


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, size", [(1, 4096), (7, 1024), (255, 3072), (2048, 6144), (3, 384)])
def test_fused_quantization(num_tokens, size, dtype):
    """RMSNorm and SiLU-and-mul writing their output as the fp8 GEMM's quantized input: the bytes
    and scales quantize_per_token_group makes of the unfused output."""
    check_fused_quantization(num_tokens, size, dtype, "cuda")


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens, num_heads, num_kv_heads, head_dim",
    [(1, 16, 8, 128), (256, 16, 8, 128), (33, 32, 8, 128), (4096, 8, 1, 64), (9, 4, 4, 64)],
)
def test_qk_norm_rope(num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    """Against the unfused layers."""
    check_qk_norm_rope(num_tokens, num_heads, num_kv_heads, head_dim, dtype, "cuda")


LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}  # fmt: skip


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, num_heads, num_kv_heads, head_dim", [(1, 32, 8, 64), (300, 14, 2, 64)])
def test_rope_without_qk_norm(num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    """The rotary-only variant (Llama, Qwen2, Mistral), with a scaled cos/sin table."""
    check_qk_norm_rope(
        num_tokens,
        num_heads,
        num_kv_heads,
        head_dim,
        dtype,
        "cuda",
        with_norm=False,
        rope=LLAMA3,
    )


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "kv_dtype, block_size, scales",
    [
        (None, 16, (1.0, 1.0)),
        (torch.float8_e4m3fn, 16, (1.0, 1.0)),
        (torch.float8_e4m3fn, 32, (0.03, 2.5)),
        (torch.float8_e4m3fn, 12, (1.0, 1.0)),
    ],
)
@pytest.mark.parametrize("num_kv_heads, head_dim, with_norm", [(8, 128, True), (2, 64, False)])
@pytest.mark.parametrize("v_tiles", [False, True])
def test_qk_norm_rope_stores_kv(
    dtype, kv_dtype, block_size, scales, num_kv_heads, head_dim, with_norm, v_tiles, monkeypatch
):
    """The fused rotary kernel's K/V store: byte for byte the attention backend's (the model
    dtype's cache, and e4m3 with the lone token's rows, a run's zeroing and a block size no power
    of 2), the q and k it returns unchanged; v_tiles: an e4m3 V stored by store_v_tiles_kernel (a
    long launch's), forced here."""
    from executor_service.attention import triton_kernels

    if v_tiles:
        monkeypatch.setattr(triton_kernels, "V_TILE_MIN_TOKENS", 0)
    check_qk_norm_rope_stores_kv(
        num_kv_heads, head_dim, dtype, kv_dtype or dtype, block_size, "cuda", scales, with_norm=with_norm
    )
