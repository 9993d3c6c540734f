"""FP8 block-scaled checkpoints (the Qwen3-*-FP8 format) on the CPU: the loader dequantizes the e4m3
weights with their 128 x 128 block scales, so greedy generation is token-identical to transformers on
the dequantized weights; unsupported schemes are refused naming what was found."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from checkpoints import FP8_QUANTIZATION_CONFIG, build_qwen3, quantize_checkpoint_fp8
from helpers.fp8_runner import load_as_runner_on_cuda
from helpers.hf_reference import make_prompts

from client.llm import LLM
from executor_service.config import ExecutorConfig
from executor_service.fp8 import dequantize_weight_blocks, quantize_weight_blocks
from scheduler_service.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def fp8_qwen3(tmp_path_factory):
    """Hidden 256, 4 x 64 query heads, 2 KV heads, intermediate 384 (blocks of 128 throughout), untied."""
    src = build_qwen3(
        tmp_path_factory.mktemp("bf"), hidden_size=256, head_dim=64, intermediate_size=384,
        num_hidden_layers=2, tie_word_embeddings=False, initializer_range=0.1, seed=3,
    )  # fmt: skip
    dst = tmp_path_factory.mktemp("fp8")
    return dst, quantize_checkpoint_fp8(src, dst)


def test_block_quantization_round_trips_within_e4m3_precision():
    w = torch.randn(300, 200) * torch.logspace(-3, 1, 300)[:, None]  # blocks of very different scales
    q, scale_inv = quantize_weight_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 2)
    back = dequantize_weight_blocks(q, scale_inv, torch.float32)
    assert ((back - w).abs() <= w.abs() * 2**-4 + scale_inv.max() * 2**-9).all()


def test_fp8_checkpoint_greedy_matches_transformers_on_dequantized_weights(fp8_qwen3):
    from transformers import AutoConfig, Qwen3ForCausalLM

    path, dequantized = fp8_qwen3
    config = AutoConfig.from_pretrained(path)
    config.quantization_config = None
    hf = Qwen3ForCausalLM(config).float().eval()
    missing, unexpected = hf.load_state_dict(dequantized, strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    prompts = make_prompts([3, 17, 40], seed=4)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16), use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            ids = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, min_new_tokens=16)
        assert out.token_ids == ids[0, len(prompt) :].tolist()
    # The loaded weights are the dequantized ones, exactly.
    qkv = llm.executor.runner.model.model.layers[1].self_attn.qkv_proj.weight
    names = [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
    assert torch.equal(qkv, torch.cat([dequantized[n] for n in names]))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
        ({"weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]: tandem reads only \[128, 128\]"),
        ({"weight_block_size": None}, "weight_block_size None"),
        ({"weight_block_size": 128}, r"weight_block_size 128: tandem reads only \[128, 128\]"),
        ({"activation_scheme": "static"}, "activation_scheme 'static'"),
    ],
)
def test_unsupported_quantization_is_refused_clearly(fp8_qwen3, tmp_path, change, message):
    path, _ = fp8_qwen3
    for f in path.iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {**FP8_QUANTIZATION_CONFIG, **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        ExecutorConfig(model=str(tmp_path))


def test_block_scales_without_a_quantization_config_are_refused(fp8_qwen3, tmp_path):
    from executor_service.executor import LocalExecutor

    path, _ = fp8_qwen3
    for f in path.iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"weight_scale_inv' is a block scale, but config\.json has no"):
        LocalExecutor(ExecutorConfig(model=str(tmp_path), num_kv_blocks=64))


def test_qwen3_moe_fp8_checkpoint_matches_transformers_on_dequantized_weights(family_checkpoint, tmp_path):
    """A Qwen3-MoE checkpoint in the Qwen3-*-FP8 format (every expert's gate / up / down in e4m3
    with block scales, the router as it was), as Qwen3-30B-A3B-FP8 ships: token-identical to
    transformers on the dequantized weights."""
    from helpers.hf_reference import MAX_NEW, assert_matches_hf
    from safetensors.torch import save_file

    src = family_checkpoint("qwen3_moe")
    dequantized = quantize_checkpoint_fp8(src, tmp_path / "fp8")
    assert any(".experts.3.down_proj.weight" in n for n in dequantized)
    reference = tmp_path / "dequantized"
    shutil.copytree(src, reference, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({n: t.contiguous() for n, t in dequantized.items()}, reference / "model.safetensors")
    prompts = make_prompts([3, 17, 40], seed=4)
    llm = LLM(str(tmp_path / "fp8"), dtype="float32", num_kv_blocks=64)
    assert llm.executor.runner.model.model.layers[0].mlp.experts.w13_weight.dtype == torch.float32
    assert_matches_hf(
        reference, prompts, llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW), use_tqdm=False)
    )


@pytest.fixture(scope="module")
def qwen3_moe_for_fp8(tmp_path_factory):
    """A Qwen3-MoE checkpoint (fp32) whose shards at TP=2 are whole blocks: 4 x 64 query heads, 4 KV
    heads, moe_intermediate 256 (each rank 128 of it); hidden 192, one and a half blocks."""
    from checkpoints import build_checkpoint

    return build_checkpoint(
        tmp_path_factory.mktemp("moe"), "qwen3_moe", hidden_size=192, head_dim=64, num_key_value_heads=4,
        moe_intermediate_size=256, num_hidden_layers=2, mlp_only_layers=[], with_tokenizer=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def fp8_qwen3_moe(tmp_path_factory, qwen3_moe_for_fp8):
    """qwen3_moe_for_fp8 as an FP8 checkpoint."""
    dst = tmp_path_factory.mktemp("moe_fp8")
    return dst, quantize_checkpoint_fp8(qwen3_moe_for_fp8, dst)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_qwen3_moe_fp8_experts_load_as_e4m3_with_their_block_scales(fp8_qwen3_moe, tp_size):
    """With the fused MoE path the experts stay e4m3: each rank's w13 holds the gate rows then the up
    rows of its slice of the intermediate dimension, w2 that slice's columns, each with its 128 x 128
    block scales; dequantized, they are exactly the checkpoint's dequantized experts."""
    from helpers.fused_moe_checks import dequantize_experts

    from executor_service.fp8 import FP8_DTYPE

    path, dequantized = fp8_qwen3_moe
    shard = 256 // tp_size
    for rank in range(tp_size):
        model = load_as_runner_on_cuda(path, rank, tp_size)
        rows = slice(rank * shard, (rank + 1) * shard)
        for layer in (0, 1):
            experts = model.model.layers[layer].mlp.experts
            assert experts.w13_weight.dtype == experts.w2_weight.dtype == FP8_DTYPE
            assert experts.w13_weight_scale_inv.shape == (8, 2 * shard // 128, 2)
            assert experts.w2_weight_scale_inv.shape == (8, 2, shard // 128)
            w13, w2 = dequantize_experts(
                experts.w13_weight,
                experts.w13_weight_scale_inv,
                experts.w2_weight,
                experts.w2_weight_scale_inv,
            )
            for e in range(8):
                name = f"model.layers.{layer}.mlp.experts.{e}"
                gate, up = dequantized[f"{name}.gate_proj.weight"], dequantized[f"{name}.up_proj.weight"]
                assert torch.equal(w13[e], torch.cat([gate[rows], up[rows]])), (rank, layer, e)
                assert torch.equal(w2[e], dequantized[f"{name}.down_proj.weight"][:, rows]), (rank, layer, e)


def test_fp8_experts_whose_shard_splits_a_block_are_refused(fp8_qwen3_moe):
    from executor_service.layers.moe import FusedMoE

    with pytest.raises(
        ValueError,
        match=r"moe_intermediate_size shard of 64 \(256 / tensor_parallel_size 4\) would split the fp8 "
        "checkpoint's blocks of 128",
    ):
        FusedMoE(8, 2, 192, 256, tp_rank=1, tp_size=4).to_fp8((128, 128))
    # One rank holds every expert whole: a partial last block is its own, so it loads.
    FusedMoE(8, 2, 192, 96, tp_rank=0, tp_size=1).to_fp8((128, 128))


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_fp8_linear_shards_at_tp2_hold_the_dequantized_shard_exactly(fp8_qwen3_moe, tp_rank):
    """On CUDA the linear layers keep e4m3 weights with their block scales; at TP=2 each rank reads
    the whole blocks of its shard (packed q/k/v and o_proj). Dequantized, every fp8 weight of a rank
    equals the weight that the CPU path (dequantizing at load) gives the same rank."""
    from executor_service.fp8 import FP8_DTYPE, dequantize_weight_blocks
    from executor_service.layers.linear import LinearBase
    from executor_service.loader import load_weights
    from executor_service.model_config import load_model_config
    from executor_service.models import get_model_class

    path, _ = fp8_qwen3_moe
    fp8 = load_as_runner_on_cuda(path, tp_rank, 2)
    mc = load_model_config(path)
    plain = get_model_class(mc.architecture)(mc, tie_word_embeddings=False, tp_rank=tp_rank, tp_size=2)
    load_weights(plain, path, quantization=mc.quantization)
    layers = [
        (n, m) for n, m in fp8.named_modules() if isinstance(m, LinearBase) and m.weight.dtype == FP8_DTYPE
    ]
    assert {n.rpartition(".")[2] for n, _ in layers} == {"qkv_proj", "o_proj"}
    for name, layer in layers:
        want = plain.get_submodule(name).weight
        got = dequantize_weight_blocks(layer.weight, layer.weight_scale_inv, torch.float32, layer.block)
        assert got.shape == want.shape and torch.equal(got, want.float()), name


def test_an_fp8_shard_that_would_split_a_block_is_refused_naming_it(fp8_qwen3):
    """At TP=2 fp8_qwen3's intermediate 384 gives each rank 192 of down_proj's columns, and its 2 KV
    heads of 64 (one block of 128 rows) give each rank 64 k rows: both would cut a block, which the
    e4m3 layout cannot hold (the CPU path dequantizes first and serves it)."""
    from executor_service.layers.linear import QKVParallelLinear

    path, _ = fp8_qwen3
    with pytest.raises(
        ValueError, match=r"this rank's columns of 192 would split the fp8 checkpoint's blocks of 128"
    ):
        load_as_runner_on_cuda(path, 0, 2)
    qkv = QKVParallelLinear(256, 64, 4, 2, bias=False, tp_rank=1, tp_size=2)
    with pytest.raises(
        ValueError, match=r"this rank's k and v rows of 64 would split the fp8 checkpoint's blocks"
    ):
        qkv.to_fp8((128, 128))


@pytest.mark.parametrize("tp_size", [1, 2])
def test_quantization_fp8_at_load_holds_what_the_fp8_checkpoint_holds(
    qwen3_moe_for_fp8, fp8_qwen3_moe, tp_size
):
    """--quantization fp8 on the unquantized checkpoint, loaded as the CUDA runner loads it (e4m3
    linear layers and experts with their block scales): every rank's parameters equal, to the bit,
    those it loads from the FP8 checkpoint made of the same weights (each weight quantized whole,
    before the rank's shard is cut)."""
    from executor_service.fp8 import FP8_DTYPE

    fp8_path, _ = fp8_qwen3_moe
    for rank in range(tp_size):
        at_load = dict(
            load_as_runner_on_cuda(qwen3_moe_for_fp8, rank, tp_size, quantize_at_load=True).named_parameters()
        )
        want = dict(load_as_runner_on_cuda(fp8_path, rank, tp_size).named_parameters())
        assert at_load.keys() == want.keys()
        assert sum(p.dtype == FP8_DTYPE for p in at_load.values()) >= 6  # qkv, o and the experts, 2 layers
        for name, param in want.items():
            got = at_load[name]
            assert got.dtype == param.dtype and torch.equal(got.float(), param.float()), (rank, name)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_quantization_fp8_at_load_matches_transformers_on_the_dequantized_weights(
    family_checkpoint, tmp_path, family
):
    """On the CPU, --quantization fp8 serves the checkpoint as its FP8 form, dequantized: greedy tokens
    identical to transformers on the block-quantized-and-dequantized weights, and to the FP8
    checkpoint itself; the unquantized checkpoint answers otherwise (the quantization is applied)."""
    from helpers.hf_reference import MAX_NEW, assert_matches_hf
    from safetensors.torch import save_file

    src = family_checkpoint(family)
    dequantized = quantize_checkpoint_fp8(src, tmp_path / "fp8")
    reference = tmp_path / "dequantized"
    shutil.copytree(src, reference, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({n: t.contiguous() for n, t in dequantized.items()}, reference / "model.safetensors")
    prompts = make_prompts([3, 17, 40], seed=4)
    params = SamplingParams(max_tokens=MAX_NEW, logprobs=2)

    def generate(path, **options):
        llm = LLM(str(path), dtype="float32", num_kv_blocks=64, **options)
        return llm.generate(prompts, params, use_tqdm=False)

    at_load = generate(src, quantization="fp8")
    assert_matches_hf(reference, prompts, at_load)
    assert [o.token_ids for o in at_load] == [o.token_ids for o in generate(tmp_path / "fp8")]
    plain = generate(src)
    moved = max(
        abs(a.logprobs[0].logprob - b.logprobs[0].logprob) for a, b in zip(at_load, plain, strict=True)
    )
    assert moved > 1e-3, moved


def test_an_unknown_quantization_is_refused_naming_the_supported_one(fp8_qwen3):
    path, _ = fp8_qwen3
    with pytest.raises(ValueError, match=r"quantization 'awq' is not supported: fp8 \(quantized at load\)"):
        ExecutorConfig(model=str(path), quantization="awq")
    # An FP8 checkpoint served with --quantization fp8 stays the checkpoint's own scheme.
    assert not ExecutorConfig(model=str(path), quantization="fp8").model_config.quantization.at_load
