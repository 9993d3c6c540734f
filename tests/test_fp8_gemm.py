"""The W8A8 block-scaled GEMM (layers/fp8_gemm_triton.py): activation quantization byte-exact against
a torch reference that quantizes the same way, the GEMM against fp32 math on the dequantized operands.
The `check_*` helpers also run on the CPU under TRITON_INTERPRET=1 (test_triton_interpret.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.fp8_gemm_checks import (
    check_fp8_linear_layers,
    check_gemm,
    check_quantize,
    check_split_k_in_kernel,
    check_swap_gemm,
)

from executor_service.fp8 import FP8_DTYPE, quantize_weight_blocks

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "k"), [(1, 4096), (7, 1024), (300, 3072), (2048, 4096)])
def test_quantize_per_token_group(m, k, dtype):
    check_quantize(m, k, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 6144, 4096), (16, 4096, 4096), (100, 256, 384), (128, 4096, 4096), (513, 24576, 4096)],
)
def test_w8a8_block_gemm(m, n, k):
    """Both of fp8_linear's GEMMs (m >= 128 takes torch._scaled_mm on the H200 where GEMM_TABLE names
    no Triton GEMM: 128 x 4096 x 4096 keeps the table's) within rounding of the dequantized math and
    of each other."""
    from executor_service.layers.fp8_gemm_triton import (
        GEMM_TABLE,
        SCALED_MM_MIN_DIM,
        SCALED_MM_MIN_TOKENS,
        m_bucket,
        scaled_mm_applies,
    )

    rel = check_gemm(m, n, k, torch.bfloat16, "cuda")
    assert rel < 0.05, f"relative error against the unquantized GEMM {rel:.3g}"
    if torch.cuda.get_device_capability() == (9, 0):
        want = (
            m >= SCALED_MM_MIN_TOKENS
            and min(n, k) >= SCALED_MM_MIN_DIM
            and (m_bucket(m), n, k) not in GEMM_TABLE
        )
        assert scaled_mm_applies(m, n, k, torch.bfloat16, torch.device("cuda")) == want


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg",
    [
        (64, 64, 4, 4, 1, 1),
        (64, 128, 4, 3, 1, 1),
        (64, 128, 4, 4, 0, 1),
        (128, 128, 8, 3, 1, 1),
        (256, 64, 8, 3, 1, 1),
        (128, 128, 16, 3, 1, 1),
        (128, 128, 8, 4, 1, 3),
    ],
)
@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 6144, 4096), (100, 256, 384), (300, 4096, 12288), (513, 24576, 4096)]
)
def test_w8a8_v2_gemm_on_gpu(m, n, k, cfg):
    """The v2 kernel's sweep candidates (bf16 out, TMA or pointer loads, split-K) within rounding of
    the dequantized math."""
    bm, bn, warps, stages, tma, split_k = cfg
    config = {"KERNEL": "v2", "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages,
              "TMA": bool(tma), "SPLIT_K": split_k}  # fmt: skip
    rel = check_gemm(m, n, k, torch.bfloat16, "cuda", config)
    assert rel < 0.05, f"relative error against the unquantized GEMM {rel:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg",
    [(64, 128, 4, 4, 1, 2), (64, 64, 4, 6, 1, 4), (128, 128, 8, 4, 1, 2), (128, 64, 8, 4, 1, 4),
     (256, 64, 16, 4, 1, 2), (64, 128, 4, 4, 3, 2), (64, 64, 4, 4, 2, 4)],
)  # fmt: skip
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 6144, 4096), (100, 320, 1040), (300, 4096, 12288), (513, 24576, 4096), (64, 256, 128)],
)
def test_w8a8_gluon_gemm_on_gpu(m, n, k, cfg):
    """The Gluon kernel (KERNEL "gluon": two or four K steps' wgmmas in flight) within rounding of the
    dequantized math, and the v2 kernel's sums with the same tiles: equal without split-K (the same
    arithmetic in the same order), within fp32 rounding with it. Partial tiles, odd and even K step
    counts (k = 1040: 9 steps, a tail of 1 or 3 taken one by one), a partial last K box and an
    empty split (k = 128 over 3)."""
    from executor_service.fp8 import quantize_weight_blocks
    from executor_service.layers.fp8_gemm_triton import (
        gluon_applies,
        quantize_per_token_group,
        w8a8_block_matmul,
    )

    bm, bn, warps, stages, split_k, products = cfg
    config = {"KERNEL": "gluon", "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages,
              "SPLIT_K": split_k, "PRODUCTS": products}  # fmt: skip
    rel = check_gemm(m, n, k, torch.bfloat16, "cuda", config)
    assert rel < 0.05, f"relative error against the unquantized GEMM {rel:.3g}"
    gen = torch.Generator(device="cuda").manual_seed(m * n + k)
    a_q, a_s = quantize_per_token_group(torch.randn(m, k, device="cuda", generator=gen).bfloat16())
    w_q, w_s = quantize_weight_blocks(torch.randn(n, k, device="cuda", generator=gen) * 0.05)
    assert gluon_applies(a_q, w_q)  # an H100 / H200: the Gluon kernel runs, not its v2 fallback
    got = w8a8_block_matmul(a_q, a_s, w_q, w_s, torch.float32, config)
    want = w8a8_block_matmul(a_q, a_s, w_q, w_s, torch.float32, {**config, "KERNEL": "v2", "TMA": True})
    tol = 0.0 if split_k == 1 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize(("cfg", "loop"), [
    ((64, 128, 4, 4, 1, 2), r"wgmma x8, wait\(1 outstanding\), FFMA x64, wait\(0 outstanding\), FFMA x64"),
    ((64, 64, 4, 6, 1, 4), r"wgmma x16, wait\(3 outstanding\), FFMA x32, wait\(2 outstanding\), FFMA x32, "
                           r"wait\(1 outstanding\), FFMA x32, wait\(0 outstanding\), FFMA x32"),
])  # fmt: skip
def test_w8a8_gluon_gemm_overlaps_its_scaling_on_sm90(cfg, loop):
    """Compiled for sm90 without a GPU, the Gluon kernel keeps what it exists for: no ptxas note of
    serialized wgmmas, and in its K loop each product's FFMAs right after the wait that leaves the
    products after it outstanding (scaled while they multiply), two or four products an iteration."""
    pytest.importorskip("triton.experimental.gluon")
    import re

    from bench import fp8_gemm_gluon as bench_gluon
    from bench.kernel_sass import cuobjdump

    kernel = bench_gluon.compile_sm90(bench_gluon.config(*cfg))
    assert bench_gluon.ptxas_notes(kernel.asm["ptx"]) == []
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        order = bench_gluon.loop_order(cuobjdump("-sass", cubin.name))
    assert re.fullmatch(loop, order), order


@pytest.mark.gpu
def test_fp8_checkpoint_greedy_matches_torch_w8a8_on_gpu(tmp_path, monkeypatch):
    """The repo's trained model quantized to FP8, served through the Triton W8A8 GEMM (CUDA graphs,
    fused ops) against the same engine with every fp8 linear replaced by the W8A8 math in torch, in
    fp32: greedy continuations agree on most tokens. Not all: quantizing activations to e4m3 makes
    W8A8 chaotic, as one element that lands on the other side of a rounding boundary moves the next
    GEMM's inputs by ~0.4%, which moves more boundaries; on the CPU the torch W8A8 math in fp32
    against the same math summed in fp64 agrees on 356 of 384 greedy prefix tokens (24 prompts x 16),
    and first tokens' logprobs differ by up to 0.12. A wrong scale or tile agrees on almost none."""
    from checkpoints import quantize_checkpoint_fp8
    from helpers.fp8_gemm_checks import reference_fp8_linear
    from tokenizers import Tokenizer

    from client.llm import LLM
    from executor_service.layers import fp8_gemm_triton
    from scheduler_service.sampling_params import SamplingParams

    model = ROOT / "models" / "tandem-tiny-pydoc"
    quantize_checkpoint_fp8(model, tmp_path / "fp8")
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    texts = ["def read_file(path):", "class Stack:\n    def push(self, x):", "import os\nimport sys\n",
             "The function returns", "for i in range(10):", "Return a list of", "    if not isinstance(x, int):",
             "with open(path) as f:"]  # fmt: skip
    prompts = [tokenizer.encode(t).ids + [i] for i, t in enumerate(texts * 3)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    runs = []
    for patched in (False, True):
        if patched:
            monkeypatch.setattr(fp8_gemm_triton, "fp8_linear", reference_fp8_linear)
        llm = LLM(str(tmp_path / "fp8"), device="cuda", dtype="float32", num_kv_blocks=256)
        assert llm.executor.runner.model.model.layers[0].mlp.down_proj.weight.dtype == FP8_DTYPE
        runs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        del llm
    got, want = runs
    agree = sum(next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want))
    assert agree >= 0.75 * sum(map(len, want)), (
        f"greedy prefixes agree on {agree} of {sum(map(len, want))} tokens"
    )


@pytest.mark.gpu
def test_every_fp8_linear_of_the_engine_matches_torch_w8a8(tmp_path):
    """Each fp8 linear layer of a served FP8 checkpoint (eager, bf16), on the inputs the engine gives
    it: its output against the W8A8 math in torch on the same input (fp32 math, bf16 rounding)."""
    from checkpoints import build_qwen3, quantize_checkpoint_fp8
    from helpers.fp8_gemm_checks import reference_fp8_linear
    from helpers.hf_reference import make_prompts

    from client.llm import LLM
    from executor_service.layers.fp8_gemm_triton import Fp8Input
    from scheduler_service.sampling_params import SamplingParams

    src = build_qwen3(tmp_path / "bf", hidden_size=256, head_dim=64, intermediate_size=384,
                      num_hidden_layers=2, initializer_range=0.1, seed=3)  # fmt: skip
    quantize_checkpoint_fp8(src, tmp_path / "fp8")
    llm = LLM(str(tmp_path / "fp8"), device="cuda", dtype="bfloat16", num_kv_blocks=64, enforce_eager=True)
    errors: dict[str, float] = {}

    def check(name):
        def hook(module, inputs, output):
            x = inputs[0]  # an Fp8Input where the fused op before quantized it
            x = x._replace(dtype=torch.float32) if isinstance(x, Fp8Input) else x.float()
            want = reference_fp8_linear(x, module.weight, module.weight_scale_inv)
            if module.bias is not None:
                want = want + module.bias.float()
            err = ((output.float() - want).norm() / want.norm().clamp(min=1e-30)).item()
            errors[name] = max(errors.get(name, 0.0), err)

        return hook

    for name, module in llm.executor.runner.model.named_modules():
        if getattr(module, "weight_scale_inv", None) is not None:
            module.register_forward_hook(check(name))
    llm.generate(
        make_prompts([3, 17, 40, 100], seed=4), SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    assert len(errors) >= 8, errors  # q/k/v, o, gate/up and down of both layers at least
    assert max(errors.values()) < 1e-2, errors


@pytest.mark.gpu
def test_fp8_linear_takes_an_input_quantized_before():
    from helpers.fp8_gemm_checks import check_fp8_linear_quantized_input

    for dtype in (torch.bfloat16, torch.float16):
        used = {
            check_fp8_linear_quantized_input(m, 3072, 4096, dtype, "cuda") for m in (1, 7, 100, 300, 2048)
        }
        if dtype == torch.bfloat16 and torch.cuda.get_device_capability() == (9, 0):
            assert used == {1, 4}, f"both GEMMs' layouts: {used}"


@pytest.mark.gpu
def test_fused_fp8_quantization_serves_the_same_tokens(tmp_path, monkeypatch):
    """An FP8 checkpoint served with its norms and activation quantizing for the fp8 GEMMs (CUDA
    graphs, bf16) against the same engine with that fusion off: the same bytes reach the GEMMs, so
    the greedy tokens and their logprobs are identical. 96 prompts admitted in one step: every GEMM
    has more than 64 rows, where the Triton GEMM does not split K over atomic adds (whose order
    varies from run to run)."""
    from checkpoints import build_qwen3, quantize_checkpoint_fp8
    from helpers.hf_reference import make_prompts

    from client.llm import LLM
    from executor_service.layers.fusable import Fusable
    from executor_service.models.base import CausalLM
    from scheduler_service.sampling_params import SamplingParams

    src = build_qwen3(tmp_path / "bf", hidden_size=256, head_dim=64, intermediate_size=384,
                      num_hidden_layers=2, initializer_range=0.1, seed=5)  # fmt: skip
    quantize_checkpoint_fp8(src, tmp_path / "fp8")
    prompts = make_prompts([3, 17, 40, 100, 30, 9, 1, 64] * 12, seed=6)
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    runs, linked = [], []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(CausalLM, "fuse_fp8_quantization", lambda self: 0)
        llm = LLM(str(tmp_path / "fp8"), device="cuda", dtype="bfloat16", num_kv_blocks=512)
        model = llm.executor.runner.model
        linked.append(sum(isinstance(m, Fusable) and m.quantize_for is not None for m in model.modules()))
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([(o.token_ids, o.logprobs) for o in outs])
        del llm
    assert linked == [6, 0], linked  # input norm, post-attention norm and activation of 2 layers
    assert all(len(lps) == 12 for _, lps in runs[0])
    assert runs[0] == runs[1]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg",
    [(16, 64, 4, 6, 1), (16, 128, 4, 4, 4), (32, 128, 4, 6, 8), (64, 128, 4, 4, 2), (64, 64, 4, 8, 3),
     (128, 128, 8, 3, 1)],
)  # fmt: skip
@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 6144, 4096), (8, 4096, 12288), (33, 256, 384), (100, 24576, 4096)]
)
def test_w8a8_swap_gemm_on_gpu(m, n, k, cfg):
    """The swap kernel's tiles (BLOCK_M tokens, BLOCK_N weight rows, split-K summed in the kernel)
    within rounding of the dequantized math and of v2, reproducible to the bit."""
    bm, bn, warps, stages, split_k = cfg
    config = {"KERNEL": "swap", "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages,
              "TMA": True, "SPLIT_K": split_k}  # fmt: skip
    check_swap_gemm(m, n, k, torch.bfloat16, "cuda", config)


@pytest.mark.gpu
def test_w8a8_swap_split_k_replays_in_a_cuda_graph():
    """A split-K swap GEMM captured once and replayed on new activations: each replay's output is
    the eager GEMM's to the bit (each tile's counter is reset by its last split inside the graph,
    and every split's sums are seen by the one that adds them)."""
    config = {"KERNEL": "swap", "BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4,
              "TMA": True, "SPLIT_K": 8}  # fmt: skip
    check_split_k_graph_replays(12, 6144, 4096, config, seed=0)


def check_split_k_graph_replays(m: int, n: int, k: int, config: dict, seed: int) -> None:
    """A split-K GEMM of m tokens captured once and replayed five times on new activations: each
    replay's output the eager GEMM's to the bit."""
    from executor_service.layers.fp8_gemm_triton import quantize_per_token_group, w8a8_block_matmul

    gen = torch.Generator("cuda").manual_seed(seed)
    w_q, w_s = quantize_weight_blocks(torch.randn(n, k, device="cuda", generator=gen) * 0.05)
    a_q, a_s = quantize_per_token_group(torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16))
    w8a8_block_matmul(a_q, a_s, w_q, w_s, torch.bfloat16, config)  # compiles; makes the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w8a8_block_matmul(a_q, a_s, w_q, w_s, torch.bfloat16, config)
    for _ in range(5):
        q, s = quantize_per_token_group(torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16))
        a_q.copy_(q)
        a_s.copy_(s)
        graph.replay()
        assert torch.equal(out, w8a8_block_matmul(q, s, w_q, w_s, torch.bfloat16, config))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m,n,k,config",
    [
        (16, 6144, 4096, {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "SPLIT_K": 4}),
        (64, 4096, 12288, {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "SPLIT_K": 8}),
        (
            128,
            4096,
            12288,
            {
                "KERNEL": "v2",
                "BLOCK_M": 128,
                "BLOCK_N": 128,
                "num_warps": 8,
                "num_stages": 4,
                "TMA": True,
                "SPLIT_K": 3,
            },
        ),
        (
            5,
            200,
            384,
            {"KERNEL": "v2", "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "SPLIT_K": 5},
        ),
    ],
)
def test_split_k_summed_in_the_kernel_on_gpu(m, n, k, config):
    """SPLIT_K_SUM_IN_KERNEL's GEMMs (v1, v2 through TMA and by pointer loads, empty shares): the
    dequantized math, the same bits run again, counters back at zero, the atomic adds' result within
    rounding (helpers/fp8_gemm_checks.check_split_k_in_kernel)."""
    check_split_k_in_kernel(m, n, k, torch.bfloat16, "cuda", config)


@pytest.mark.gpu
def test_split_k_summed_in_the_kernel_replays_in_a_cuda_graph():
    """A v1 split-K GEMM summed in the kernel, captured once and replayed on new activations: each
    replay's output is the eager GEMM's to the bit (the counters reset inside the graph)."""
    config = {
        "BLOCK_M": 16,
        "BLOCK_N": 64,
        "num_warps": 4,
        "num_stages": 3,
        "SPLIT_K": 8,
        "SUM_IN_KERNEL": True,
    }
    check_split_k_graph_replays(9, 4096, 4096, config, seed=1)


@pytest.mark.gpu
def test_fp8_linear_layers_on_gpu():
    check_fp8_linear_layers("cuda")


# The v2 kernel (w8a8_block_matmul_v2_kernel) under TRITON_INTERPRET=1, in a subprocess as
# test_triton_interpret.py runs the others: pointer loads and TMA descriptors, partial M and N tiles,
# a K that is no multiple of 128 (TMA's zero fill; K = 200 is no multiple of 16 either, so TMA falls
# back to pointers), split-K with empty shares, against fp32 math on the dequantized operands.
V2_CASE = """
from helpers.fp8_gemm_checks import check_gemm
from executor_service.layers import fp8_gemm_triton as g
for tma in (False, True):
    small = {"KERNEL": "v2", "TMA": tma, "BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    check_gemm(5, 72, 256, torch.float32, "cpu", small)  # partial M and N tiles, two K steps
    check_gemm(17, 160, 384, torch.float32, "cpu", small)  # several M tiles, N scale blocks of 128
    check_gemm(9, 96, 320, torch.float32, "cpu", {**small, "BLOCK_N": 64})  # a partial K step
    check_gemm(9, 96, 200, torch.float32, "cpu", small)  # K % 16 != 0: pointer loads
    check_gemm(17, 160, 384, torch.float32, "cpu", {**small, "SPLIT_K": 2})  # shares of 2 and 1 steps
    check_gemm(5, 72, 256, torch.float32, "cpu", {**small, "SPLIT_K": 4})  # more shares than steps
    check_gemm(40, 256, 256, torch.float32, "cpu", {**small, "BLOCK_M": 32, "BLOCK_N": 128})
    # The Gluon kernel's configuration where it cannot run (the interpreter): v2 with its tiles.
    check_gemm(17, 160, 384, torch.float32, "cpu", {**small, "KERNEL": "gluon", "SPLIT_K": 2})
# The swap kernel: tokens as the narrow side, several row tiles, split-K (2 and 3 shares, and more
# shares than K steps: empty ones) summed by each tile's last split; TMA and pointer loads.
from helpers.fp8_gemm_checks import check_swap_gemm
for tma in (False, True):
    swap = {"KERNEL": "swap", "TMA": tma, "BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    check_swap_gemm(5, 72, 256, torch.float32, "cpu", swap)  # partial M and N tiles, two K steps
    check_swap_gemm(40, 160, 384, torch.float32, "cpu", swap)  # three row tiles, N scale blocks of 128
    check_swap_gemm(40, 160, 384, torch.float32, "cpu", {**swap, "SPLIT_K": 2})
    check_swap_gemm(17, 96, 640, torch.bfloat16, "cpu", {**swap, "BLOCK_N": 64, "SPLIT_K": 3})
    check_swap_gemm(5, 72, 256, torch.float32, "cpu", {**swap, "SPLIT_K": 4})
    check_swap_gemm(9, 96, 200, torch.float32, "cpu", {**swap, "SPLIT_K": 2})  # K % 16 != 0: pointers
# swap_config's rule, where SWAP_MAX_TOKENS turns it on: fp8_linear's GEMM up to that many tokens.
g.SWAP_MAX_TOKENS = 16
assert g.gemm_config(5, 256, 384)["KERNEL"] == "swap" and g.gemm_config(17, 256, 384).get("KERNEL") != "swap"
check_gemm(5, 256, 384, torch.float32, "cpu")  # 2 tiles, K in 8 shares of 3 steps
g.SWAP_MAX_TOKENS = 0
# Contiguous rows of K = 200 (check_gemm's activations are a view of rows padded to 256 with zeros):
# what a load past K would read is the next row.
from helpers.fp8_gemm_checks import _dequantize_rows, reference_quantize
from executor_service.fp8 import dequantize_weight_blocks, quantize_weight_blocks
gen = torch.Generator().manual_seed(1)
a_q, a_s = reference_quantize(torch.randn(9, 200, generator=gen))
w_q, w_s = quantize_weight_blocks(torch.randn(96, 200, generator=gen))
out = g.w8a8_block_matmul(a_q.contiguous(), a_s, w_q, w_s, torch.float32, small)
ref = _dequantize_rows(a_q, a_s) @ dequantize_weight_blocks(w_q, w_s, torch.float32).T
torch.testing.assert_close(out, ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)
# The table overrides gemm_config's rule for its (m bucket, n, k) only.
g.GEMM_TABLE[(64, 160, 384)] = {**small, "BLOCK_M": 32}
assert g.gemm_config(33, 160, 384)["KERNEL"] == "v2"
assert "KERNEL" not in g.gemm_config(32, 160, 384) and "KERNEL" not in g.gemm_config(65, 160, 384)
check_gemm(33, 160, 384, torch.float32, "cpu")
"""


@pytest.mark.slow
def test_w8a8_v2_gemm_under_interpreter():
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    from helpers.interpret import PRELUDE

    result = subprocess.run(
        [sys.executable, "-c", PRELUDE + V2_CASE],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]


def _blockwise_reference(a_q, w_t, a_s, s_t) -> torch.Tensor:
    """torch._scaled_mm's blockwise math on the CPU for k_halves' operands: the activation with a
    scale per row and 128 columns, the weight^T with one per 128 x 128 block."""
    w = w_t.t()
    weight = (
        w.float() * s_t.t().repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
    )
    return (a_q.float() * a_s.repeat_interleave(128, 1)) @ weight.t()


def test_k_halves_cover_every_column_with_its_own_scales():
    """The two halves' operands (views of the activation, the weight and both scales) add up to the
    whole GEMM: a half reading the other half's scales, or a column twice, gives another sum."""
    from executor_service.layers.fp8_gemm_triton import k_halves

    gen = torch.Generator().manual_seed(3)
    w_q, w_s = quantize_weight_blocks(torch.randn(256, 1024, generator=gen))
    a_q = (torch.randn(8, 1024, generator=gen) * 50).to(FP8_DTYPE)
    # column-major activation scales, as torch._scaled_mm takes them
    a_s = (torch.rand(1024 // 128, 8, generator=gen) + 0.5).t()
    halves = k_halves(a_q, a_s, w_q, w_s)
    assert [h[0].shape[1] for h in halves] == [512, 512]
    # the layouts torch's blockwise GEMM takes: the activation's scales column-major with a column
    # stride of its rows, the weight's scales (passed transposed) contiguous
    assert all(h[2].stride() == (1, 8) and h[3].t().is_contiguous() for h in halves)
    assert k_halves(a_q, a_s, w_q, w_s)[1][3].data_ptr() == halves[1][3].data_ptr()  # made once
    whole = _blockwise_reference(a_q, w_q.t(), a_s, w_s.t())
    split = sum(_blockwise_reference(*h) for h in halves)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-3)
    assert not torch.allclose(_blockwise_reference(*halves[0]), whole, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_scaled_mm_split_k_matches_the_whole_gemm_and_replays_in_a_cuda_graph(monkeypatch):
    """W4's down projection at 256 tokens through torch._scaled_mm in two K halves on two streams:
    within an fp32 rounding of the whole GEMM, eager and captured in a CUDA graph (fork and join)
    on new activations; fp8_linear takes it where SCALED_MM_SPLIT_K allows."""
    from executor_service.layers import fp8_gemm_triton as g

    monkeypatch.setattr(g, "_split_k_agrees", {})
    if not g.scaled_mm_applies(256, 4096, 12288, torch.bfloat16, torch.device("cuda")):
        pytest.skip("torch._scaled_mm has no blockwise-scaled GEMM on this GPU")
    gen = torch.Generator("cuda").manual_seed(0)
    w_q, w_s = quantize_weight_blocks(torch.randn(4096, 12288, device="cuda", generator=gen) * 0.05)

    def whole(q, s):
        return torch._scaled_mm(q, w_q.t(), scale_a=s, scale_b=w_s.t(), out_dtype=torch.bfloat16)

    x = torch.randn(256, 12288, device="cuda", generator=gen, dtype=torch.bfloat16)
    a_q, a_s = g.quantize_per_token_group(x, rows_multiple=4)
    torch.testing.assert_close(g.scaled_mm_split_k(a_q, a_s, w_q, w_s, torch.bfloat16), whole(a_q, a_s))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = g.scaled_mm_split_k(a_q, a_s, w_q, w_s, torch.bfloat16)
    for _ in range(3):
        q, s = g.quantize_per_token_group(
            torch.randn(256, 12288, device="cuda", generator=gen, dtype=torch.bfloat16), rows_multiple=4
        )
        a_q.copy_(q)
        a_s.copy_(s)
        graph.replay()
        torch.testing.assert_close(out, whole(q, s))
    monkeypatch.setattr(g, "SCALED_MM_SPLIT_K", True)
    assert g.scaled_mm_splits_k(256, 4096, 12288, x.device)
    assert not g.scaled_mm_splits_k(512, 4096, 12288, x.device)  # 128 tiles: already fills the SMs
    calls = []
    monkeypatch.setattr(g, "scaled_mm_split_k", lambda *a: calls.append(a) or whole(*a[:2]))
    g.fp8_linear(x, w_q, w_s)
    assert len(calls) == 1
