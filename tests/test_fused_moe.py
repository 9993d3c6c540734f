"""The fused MoE kernels (executor_service/layers/fused_moe_triton.py) against the reference expert
loop (layers/moe.py), and the reference against transformers' sparse block. The kernels' logic runs
on the CPU under TRITON_INTERPRET=1 (tests/test_triton_interpret.py, cases "fused_moe" and
"fused_moe_fp8", the W8A8 GEMMs of fp8 experts against torch on the same quantization); the GPU
tests take the H200 sizes (Qwen3-30B-A3B: 128 experts, top 8, hidden 2048, intermediate 768)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.fused_moe_checks import LOADS, check_fused_moe, check_fused_moe_fp8, make_moe, quantize_experts

pytest.importorskip("triton")

# (num_tokens, experts that receive tokens: all, or only this many, leaving the others empty)


def check_route(num_tokens, num_experts, top_k, hidden, dtype, device, renormalize=True, config=None):
    """The fused router (config: ROUTE_CONFIG's form, splits of the hidden dimension included)
    against the router's definition (layers/moe.route, transformers' Qwen3MoeTopKRouter): logits
    rounded to the model dtype, softmax in fp32, top-k. On inputs whose sums are exact in fp32
    (7-bit integers over powers of 2, their sums wider than the dtype keeps), the same experts in the same order, ties to the lower
    expert, and the weights to the dtype's rounding; on random inputs, experts that are a top-k of
    the rounded logits up to two rounding steps; and each token routed the same, to the bit, in a
    batch of its own."""
    from executor_service.layers import fused_moe_triton

    gen = torch.Generator(device).manual_seed(num_tokens)
    # A rounding step of the logits: the dtype's (bf16, fp16), or for fp32 the error of the kernel's
    # fp32 sums over 2,048 columns (~1e-5 of the largest logit, not one ulp).
    step = {torch.float32: 2.0**-17, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    for exact in (True, False):
        if exact:  # 7-bit integers over powers of 2: sums exact in fp32, wider than the dtype
            x = (torch.randint(-64, 65, (num_tokens, hidden), generator=gen, device=device) / 64).to(dtype)
            scale = 2.0 ** round(math.log2(hidden**0.5 * 1387 / 64))  # logits of about unit spread
            router = torch.randint(-64, 65, (num_experts, hidden), generator=gen, device=device) / scale
            router = router.to(dtype)
        else:
            x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
            router = (torch.randn(num_experts, hidden, generator=gen, device=device) / hidden**0.5).to(dtype)
        weights, ids = fused_moe_triton.route(x, router, top_k, renormalize, config)
        assert ids.dtype == torch.int64 and weights.dtype == dtype
        for t in {0, num_tokens // 2, num_tokens - 1}:
            alone = fused_moe_triton.route(x[t : t + 1], router, top_k, renormalize, config)
            assert torch.equal(alone[1][0], ids[t]), f"token {t} alone: other experts"
            if device == "cpu" and dtype == torch.float32 and not exact:
                # Triton's interpreter runs tl.dot as numpy's matmul, whose fp32 result for a row can
                # depend on the row's place in the tile (numpy 2.4.6); the GPU keeps the bits.
                torch.testing.assert_close(alone[0][0], weights[t], atol=1e-6, rtol=1e-6)
            else:
                assert torch.equal(alone[0][0], weights[t]), f"token {t} alone"
        # The logits in the model dtype, from sums in float64 (exact for the exact inputs).
        rounded = (x.double() @ router.double().T).to(dtype).double().cpu()
        ids, weights = ids.cpu(), weights.cpu()
        if exact:
            want_ids = torch.sort(-rounded, dim=-1, stable=True).indices[:, :top_k]  # ties: lower expert
            assert torch.equal(ids, want_ids), f"route ids at {num_tokens} tokens"
            probs = torch.softmax(rounded, dim=-1).gather(1, want_ids)
            if renormalize:
                probs = probs / probs.sum(dim=-1, keepdim=True)
            torch.testing.assert_close(weights.double(), probs, atol=tol, rtol=tol)
        else:
            chosen = rounded.gather(1, ids)
            kth = rounded.topk(top_k, dim=-1).values[:, -1:]
            slack = 2 * step * rounded.abs().amax(dim=-1, keepdim=True)
            assert (chosen >= kth - slack).all(), (
                f"route at {num_tokens} tokens: an expert outside the top {top_k}"
            )
            assert (chosen[:, :-1] >= chosen[:, 1:] - slack).all(), (
                f"route at {num_tokens} tokens: out of order"
            )


def check_align(num_tokens, num_experts, top_k, block_m, used=None, device="cpu", reference=True):
    """The align's layout invariants, and the Triton align (reference=False) equal to the torch one."""
    from executor_service.layers import fused_moe_triton

    _, _, _, _, ids = make_moe(num_tokens, num_experts, top_k, 8, 8, torch.float32, device, used)
    aligned = fused_moe_triton.align_block_size_reference(ids, num_experts, block_m)
    if not reference:
        got = fused_moe_triton.align_block_size(ids, num_experts, block_m)
        for name, want, have in zip(("sorted_ids", "expert_ids", "num_padded"), aligned, got, strict=True):
            assert have.dtype == torch.int32 and torch.equal(have, want), f"{name} at {num_tokens} tokens"
    sorted_ids, expert_ids, num_padded = aligned
    num_pairs = ids.numel()
    flat = ids.flatten().cpu()
    sorted_ids, expert_ids, used_rows = sorted_ids.cpu(), expert_ids.cpu(), int(num_padded)
    real = sorted_ids[sorted_ids < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs)), "each pair exactly once"
    assert used_rows % block_m == 0 and (sorted_ids[used_rows:] == num_pairs).all()
    counts = torch.bincount(flat, minlength=num_experts)
    assert used_rows == int(((counts + block_m - 1) // block_m * block_m).sum()), "empty experts get no block"
    for block in range(used_rows // block_m):
        rows = sorted_ids[block * block_m : (block + 1) * block_m]
        rows = rows[rows < num_pairs]
        assert len(rows) and (flat[rows.long()] == expert_ids[block]).all(), f"block {block}"


def check_align_from_route_counts(num_tokens, num_experts, top_k, block_m, device="cpu", route_config=None):
    """The router's per-program expert counts (route_counts) in place of the align's counting
    kernel: the same layout as the torch align, and the same fused_experts output, to the bit."""
    from executor_service.layers import fused_moe_triton as k

    gen = torch.Generator(device).manual_seed(num_tokens + top_k)
    hidden = 32
    x = torch.randn(num_tokens, hidden, generator=gen, device=device)
    router = torch.randn(num_experts, hidden, generator=gen, device=device)
    counts = k.route_counts(num_tokens, num_experts, device)
    assert counts is not None
    weights, ids = k.route(x, router, top_k, True, route_config, counts=counts)
    want = k.align_block_size_reference(ids, num_experts, block_m)
    got = k.align_block_size(ids, num_experts, block_m, counts)
    for name, w, g in zip(("sorted_ids", "expert_ids", "num_padded"), want, got, strict=True):
        assert torch.equal(g, w), f"{name} at {num_tokens} tokens, top {top_k}"
    _, w13, w2, _, _ = make_moe(num_tokens, num_experts, top_k, hidden, 16, torch.float32, device)
    config = k.MoEConfig(block_m, 16, 16, 4, 2)
    plain = k.fused_experts(x, w13, w2, weights, ids, config)
    counted = k.fused_experts(x, w13, w2, weights, ids, config, expert_counts=counts)
    torch.testing.assert_close(counted, plain, atol=0, rtol=0)


def test_route_counts_cover_the_align_only_up_to_its_programs():
    from executor_service.layers import fused_moe_triton as k

    assert k.route_counts(0, 8, "cpu") is None
    assert k.route_counts(k.ROUTE_BLOCK_T * 64, 128, "cpu").shape == (64, 128)
    assert k.route_counts(k.ROUTE_BLOCK_T * 64 + 1, 128, "cpu") is None  # the align's counting kernel then
    assert k.route_counts(17, 6, "cpu").shape == (2, 8)


@pytest.mark.parametrize(("num_tokens", "used"), LOADS)
@pytest.mark.parametrize("block_m", [16, 64])
def test_align_sorts_pairs_into_expert_blocks(num_tokens, used, block_m):
    check_align(num_tokens, 8, 2, block_m, used)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_reference_block_matches_transformers(norm_topk_prob):
    """Router (logits in the model dtype, softmax in fp32, top-k, renormalised or not) and the
    expert loop, fed transformers' own Qwen3MoeSparseMoeBlock weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from executor_service.layers.moe import SparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
                            norm_topk_prob=norm_topk_prob)  # fmt: skip
    torch.manual_seed(0)
    hf = Qwen3MoeSparseMoeBlock(config).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ours = SparseMoeBlock(64, 8, 3, 32, norm_topk_prob)
    ours.gate.weight.data.copy_(hf.gate.weight)
    ours.experts.w13_weight.data.copy_(hf.experts.gate_up_proj)
    ours.experts.w2_weight.data.copy_(hf.experts.down_proj)
    x = torch.randn(1, 40, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x[0]), hf(x)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_picks_transformers_experts_and_weights_to_the_bit(dtype):
    """layers/moe.route against transformers' Qwen3MoeTopKRouter in bf16 at Qwen3-30B-A3B's 128
    experts, top 8: the same experts in the same order and the same weights for every token. The
    logits are rounded to bf16 there (a GEMM in the model dtype), which decides near ties: with
    them in fp32, 305 of these 2,048 tokens took other experts or another order."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from executor_service.layers.moe import route

    config = Qwen3MoeConfig(hidden_size=256, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)
    hf = Qwen3MoeTopKRouter(config).to(dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf.weight.copy_((torch.randn(128, 256, generator=gen) / 16).to(dtype))
        x = torch.randn(2048, 256, generator=gen).to(dtype)
        _, want_weights, want_ids = hf(x)
        weights, ids = route(x, hf.weight, 8, True)
    assert torch.equal(ids, want_ids)
    assert weights.dtype == want_weights.dtype == dtype and torch.equal(weights, want_weights)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_experts_are_transformers_default_experts_to_the_bit(dtype):
    """layers/moe.experts_reference against transformers' Qwen3MoeExperts in its default
    implementation (grouped_mm: each pair's weighted output in the model dtype, a token's k pairs
    summed in fp32 and rounded once) at 64 experts, top 8: the same output, to the bit. Summed into
    a bf16 output expert by expert (the eager loop's index_add_), about half of these differed."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeTopKRouter

    from executor_service.layers.moe import experts_reference

    config = Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=64, num_experts=64, num_experts_per_tok=8,
                            norm_topk_prob=True, experts_implementation="grouped_mm")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    hf, router = Qwen3MoeExperts(config).to(dtype), Qwen3MoeTopKRouter(config).to(dtype)
    assert hf.config._experts_implementation == "grouped_mm"
    with torch.no_grad():
        for p in (hf.gate_up_proj, hf.down_proj, router.weight):
            p.copy_((torch.randn(p.shape, generator=gen) / 8).to(dtype))
        x = torch.randn(300, 256, generator=gen).to(dtype)
        _, weights, ids = router(x)
        want = hf(x, ids, weights)
        got = experts_reference(x, hf.gate_up_proj, hf.down_proj, weights, ids)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want), f"{(got != want).float().mean():.1%} of the outputs differ"


# -- on the GPU -------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
H200_SHAPE = dict(num_experts=128, top_k=8, hidden=2048, n=768)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 2, 7, 31, 64, 255, 256, 512, 1000, 2048, 4096, 8192])
def test_fused_moe_matches_reference_on_gpu(num_tokens, dtype):
    check_fused_moe(num_tokens, dtype=dtype, device="cuda", **H200_SHAPE)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(("num_tokens", "used"), [(256, 8), (256, 1), (3, 8), (4096, 16)])
def test_fused_moe_with_empty_experts_on_gpu(num_tokens, used):
    check_fused_moe(num_tokens, dtype=torch.bfloat16, device="cuda", used=used, **H200_SHAPE)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_fused_moe_align_on_gpu(block_m):
    """The Triton align equals the torch one: one chunk, several, up to 64 programs of many chunks."""
    for num_tokens, used in [
        (1, None),
        (7, None),
        (256, None),
        (256, 3),
        (1000, 60),
        (4096, None),
        (9000, None),
    ]:
        check_align(num_tokens, 128, 8, block_m, used, device="cuda", reference=False)
    check_align(100, 60, 4, block_m, device="cuda", reference=False)  # experts not a power of two


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_route_on_gpu(dtype):
    for num_tokens in (1, 7, 256, 2049):
        check_route(num_tokens, 128, 8, 2048, dtype, "cuda")
        for splits in (2, 3, 8):  # 3: slices of unequal width
            check_route(num_tokens, 128, 8, 2048, dtype, "cuda", config=(128, 4, 2, splits))
    check_route(33, 60, 4, 2048, dtype, "cuda", renormalize=False)
    check_route(33, 60, 4, 2048, dtype, "cuda", renormalize=False, config=(64, 4, 3, 4))


@pytest.mark.gpu
@cuda
def test_fused_moe_captures_in_a_cuda_graph():
    """A decode-sized call replays from a CUDA graph with new routings and equals eager."""
    from executor_service.layers.fused_moe_triton import fused_experts

    x, w13, w2, weights, ids = make_moe(256, device="cuda", dtype=torch.bfloat16, **H200_SHAPE)
    fused_experts(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w13, w2, weights, ids)
    for seed in (1, 2):
        x2, _, _, weights2, ids2 = make_moe(256, device="cuda", dtype=torch.bfloat16, seed=seed, **H200_SHAPE)
        x.copy_(x2), weights.copy_(weights2), ids.copy_(ids2)
        graph.replay()
        torch.testing.assert_close(out, fused_experts(x, w13, w2, weights, ids), atol=0, rtol=0)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 256, 1000, 4096])
def test_fused_moe_fp8_matches_torch_w8a8_on_gpu(num_tokens):
    """e4m3 experts with 128 x 128 block scales (bf16 activations, quantized per row in groups of 128)
    against the same W8A8 math in torch, each CONFIGS tile at fp8's BLOCK_K of 128."""
    check_fused_moe_fp8(num_tokens, dtype=torch.bfloat16, device="cuda", **H200_SHAPE)
    check_fused_moe_fp8(num_tokens, dtype=torch.bfloat16, device="cuda", used=3, **H200_SHAPE)


@pytest.mark.gpu
@cuda
def test_fused_moe_fp8_captures_in_a_cuda_graph():
    """The fp8 path (two activation quantizations, the W8A8 GEMMs) replays from a CUDA graph with
    new inputs and routings and equals eager."""
    from executor_service.layers.fused_moe_triton import fused_experts

    x, w13, w2, weights, ids = make_moe(256, device="cuda", dtype=torch.bfloat16, **H200_SHAPE)
    w13_q, w13_s, w2_q, w2_s = quantize_experts(w13.float(), w2.float())
    del w13, w2

    def run():
        return fused_experts(x, w13_q, w2_q, weights, ids, w13_scale=w13_s, w2_scale=w2_s)

    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed in (1, 2):
        x2, _, _, weights2, ids2 = make_moe(256, device="cuda", dtype=torch.bfloat16, seed=seed, **H200_SHAPE)
        x.copy_(x2), weights.copy_(weights2), ids.copy_(ids2)
        graph.replay()
        torch.testing.assert_close(out, run(), atol=0, rtol=0)


def test_align_kernels_under_interpreter():
    """The Triton align equals the torch one, its kernels run on the CPU by Triton's interpreter."""
    import os
    import subprocess
    import sys

    from helpers.interpret import PRELUDE, ROOT

    script = PRELUDE + (
        "from test_fused_moe import check_align\n"
        "for n, used in [(1, None), (5, 3), (64, None), (130, 5), (600, None)]:\n"
        "    for block_m in (16, 64):\n"
        "        check_align(n, 8, 2, block_m, used, reference=False)\n"
        "check_align(40, 6, 3, 16, reference=False)\n"
        "from test_fused_moe import check_route\n"
        "for n in (1, 17, 40):\n"
        "    check_route(n, 8, 2, 48, torch.float32, 'cpu')\n"
        "    check_route(n, 12, 3, 64, f16, 'cpu', renormalize=False)\n"
        "    check_route(n, 8, 2, 48, torch.float32, 'cpu', config=(16, 4, 2, 3))\n"
        "    check_route(n, 12, 3, 80, f16, 'cpu', config=(32, 4, 2, 2))  # slices of 48 and 32\n"
        "check_align(2100, 8, 2, 16, reference=False)  # 4200 pairs: two steps of each program's loop\n"
        "from test_fused_moe import check_align_from_route_counts\n"
        "for n, e, k, bm in [(1, 8, 2, 16), (17, 8, 2, 16), (40, 6, 3, 16), (100, 12, 8, 32)]:\n"
        "    check_align_from_route_counts(n, e, k, bm)\n"
        "check_align_from_route_counts(40, 6, 3, 16, route_config=(16, 4, 2, 2))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
