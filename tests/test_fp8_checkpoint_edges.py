"""FP8 block-scaled checkpoints at their edges, on the CPU: weights that are not whole 128 x 128 blocks,
tensor-parallel shards that cut blocks, layers left unquantized, and checkpoints whose tensors do not
hold what the format says (another dtype, no block scales, scales of another grid), which are refused
naming the tensor rather than read as wrong numbers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from checkpoints import build_qwen3, quantize_checkpoint_fp8
from helpers.hf_reference import make_prompts
from safetensors.torch import load_file, save_file

from client.llm import LLM
from executor_service.config import ExecutorConfig
from executor_service.fp8 import dequantize_weight_blocks, quantize_weight_blocks
from scheduler_service.sampling_params import SamplingParams

DOWN = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def partial_blocks(tmp_path_factory):
    """(unquantized checkpoint, fp8 checkpoint, its dequantized weights): hidden 320 (two and a half
    blocks), 4 x 80 query heads, 2 KV heads (k and v rows 160), intermediate 192: no weight is whole
    blocks, and at TP=2 and 4 every shard (160 / 80 q rows, 80 k rows, 96 / 48 MLP rows, 160 / 80
    o_proj columns) cuts a block."""
    src = build_qwen3(
        tmp_path_factory.mktemp("bf"), hidden_size=320, head_dim=80, num_attention_heads=4,
        intermediate_size=192, num_hidden_layers=2, tie_word_embeddings=False, initializer_range=0.1,
        seed=3, with_tokenizer=False,
    )  # fmt: skip
    dst = tmp_path_factory.mktemp("fp8")
    return src, dst, quantize_checkpoint_fp8(src, dst)


def _greedy(path, prompts):
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)]


def _hf_greedy(path, state, prompts):
    """transformers on `state` (the dequantized weights) with the checkpoint's config."""
    from transformers import AutoConfig, Qwen3ForCausalLM

    config = AutoConfig.from_pretrained(path)
    config.quantization_config = None
    hf = Qwen3ForCausalLM(config).float().eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    with torch.no_grad():
        return [
            hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=8, min_new_tokens=8)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


def _copy(src, dst, change_weights=None, change_quantization=None):
    """A copy of checkpoint `src` at `dst`, its tensors through change_weights(dict) and its
    quantization_config updated with change_quantization."""
    shutil.copytree(src, dst)
    if change_weights is not None:
        weights = load_file(dst / "model.safetensors")
        change_weights(weights)
        save_file({n: t.contiguous() for n, t in weights.items()}, dst / "model.safetensors")
    if change_quantization is not None:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"].update(change_quantization)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_partial_blocks_match_transformers_on_the_dequantized_weights(partial_blocks):
    _, path, dequantized = partial_blocks
    prompts = make_prompts([3, 17], seed=4)
    assert _greedy(path, prompts) == _hf_greedy(path, dequantized, prompts)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_shards_that_cut_blocks_hold_the_dequantized_shard_exactly(partial_blocks, tmp_path, tp_size):
    """On the CPU each rank dequantizes the whole blocks around its shard and cuts the shard out:
    every rank's parameters equal, to the bit, those it loads from the dequantized checkpoint."""
    from executor_service.loader import load_weights
    from executor_service.model_config import load_model_config
    from executor_service.models import get_model_class

    src, path, dequantized = partial_blocks
    reference = tmp_path / "dequantized"
    shutil.copytree(src, reference, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({n: t.contiguous() for n, t in dequantized.items()}, reference / "model.safetensors")

    def load(checkpoint, rank):
        mc = load_model_config(checkpoint)
        model = get_model_class(mc.architecture)(mc, tie_word_embeddings=False, tp_rank=rank, tp_size=tp_size)
        load_weights(model, checkpoint, quantization=mc.quantization)
        return dict(model.named_parameters())

    for rank in range(tp_size):
        got, want = load(path, rank), load(reference, rank)
        assert got.keys() == want.keys()
        for name, param in want.items():
            assert torch.equal(got[name], param), (rank, name)


@pytest.mark.slow
@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_service_on_shards_that_cut_blocks_is_token_identical_to_tp1(partial_blocks, tmp_path, tp_size):
    from helpers.tp_generate import generate, start_tp_executor, tp1_tokens

    from scheduler_service.executor_client import RemoteExecutor

    _, path, _ = partial_blocks
    expected = tp1_tokens(path)
    ep = start_tp_executor(path, tmp_path / "executor.log", tp=tp_size)
    try:
        ep.wait_serving()
        with RemoteExecutor(ep.address) as remote:
            assert generate(remote)[0] == expected
    finally:
        ep.stop()


def test_unquantized_layers_and_an_fp8_lm_head_match_transformers(partial_blocks, tmp_path):
    """Layer 1's MLP kept in fp32 (`modules_to_not_convert` / `ignored_layers`: no weight_scale_inv)
    and the LM head in e4m3 with its block scales: each is read as the checkpoint holds it."""
    src, path, dequantized = partial_blocks
    original = load_file(src / "model.safetensors")
    state = dict(dequantized)
    kept = [f"model.layers.1.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    head, head_scale = quantize_weight_blocks(original["lm_head.weight"])

    def change(weights):
        for name in kept:
            weights[name] = state[name] = original[name]
            del weights[name + "_scale_inv"]
        weights["lm_head.weight"], weights["lm_head.weight_scale_inv"] = head, head_scale

    state["lm_head.weight"] = dequantize_weight_blocks(head, head_scale, torch.float32)
    ignored = ["model.layers.1.mlp"]
    path = _copy(
        path, tmp_path / "mixed", change, {"modules_to_not_convert": ignored, "ignored_layers": ignored}
    )
    prompts = make_prompts([3, 17], seed=4)
    assert _greedy(path, prompts) == _hf_greedy(path, state, prompts)


def _as_uint8(w):
    w[DOWN] = w[DOWN].view(torch.uint8)


def _as_bf16(w):
    w[DOWN] = w[DOWN].to(torch.bfloat16)


def _as_e5m2(w):
    w[DOWN] = w[DOWN].float().to(torch.float8_e5m2)


def _without_scale(w):
    del w[DOWN + "_scale_inv"]


def _per_tensor_scale(w):
    w[DOWN.replace("weight", "weight_scale")] = w.pop(DOWN + "_scale_inv").max().reshape(())


def _scale_blocks(rows, cols):
    def change(w):
        w[DOWN + "_scale_inv"] = w[DOWN + "_scale_inv"].repeat(2, 2)[:rows, :cols]

    return change


MISSTORED = [
    (_as_uint8, r"'model.layers.0.mlp.down_proj.weight' has a weight_scale_inv but is stored as U8"),
    (_as_bf16, r"'model.layers.0.mlp.down_proj.weight' has a weight_scale_inv but is stored as BF16"),
    (_as_e5m2, r"stored as F8_E5M2: the weights of an fp8 checkpoint must be e4m3"),
    (_without_scale, r"'model.layers.0.mlp.down_proj.weight' is F8_E4M3 but has no model\.layers\.0\.mlp"),
    (_per_tensor_scale, r"is F8_E4M3 but has no .*per-tensor weight_scale is not supported"),
    # down_proj [320, 192]: a grid of (3, 2) blocks.
    (_scale_blocks(3, 1), r"down_proj.weight_scale_inv' of shape \(3, 1\) for a weight \(320, 192\) .*: expected \(3, 2\)"),
    (_scale_blocks(3, 4), r"down_proj.weight_scale_inv' of shape \(3, 4\) for a weight \(320, 192\)"),
    (_scale_blocks(6, 2), r"down_proj.weight_scale_inv' of shape \(6, 2\)"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    MISSTORED,
    ids=["uint8", "bf16", "e5m2", "no_scale", "per_tensor_scale", "scale_3x1", "scale_3x4", "scale_6x2"],
)
def test_misstored_fp8_tensors_are_refused_naming_the_tensor(partial_blocks, tmp_path, change, message):
    """Each was read as wrong numbers (e4m3 bytes as integers, unscaled e4m3, a 16-bit weight
    scaled again) or, for extra blocks, by position without notice on the e4m3 (CUDA) path."""
    from executor_service.executor import LocalExecutor

    _, path, _ = partial_blocks
    path = _copy(path, tmp_path / "bad", change)
    with pytest.raises(ValueError, match=message):
        LocalExecutor(ExecutorConfig(model=str(path), num_kv_blocks=64))


def test_block_scales_without_a_quantization_config_are_refused_naming_them(partial_blocks, tmp_path):
    """An FP8 checkpoint whose config.json lost its quantization_config: said so, naming a scale
    (not a TypeError from the block checks, which need the config's block size)."""
    from executor_service.executor import LocalExecutor

    _, path, _ = partial_blocks
    path = _copy(path, tmp_path / "bad")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.\d+\..*weight_scale_inv' is a block scale, but config.json has no quantization_config",
    ):
        LocalExecutor(ExecutorConfig(model=str(path), num_kv_blocks=64))


def test_extra_scale_columns_are_refused_where_layers_stay_e4m3(tmp_path):
    """The CUDA runner's e4m3 layers read each rank's scales by position: an o_proj scale grid of
    (2, 4) for a [256, 256] weight loaded, its first two columns taken, at TP=1 and 2."""
    from helpers.fp8_runner import load_as_runner_on_cuda

    src = build_qwen3(
        tmp_path / "bf", hidden_size=256, head_dim=64, num_key_value_heads=4, intermediate_size=256,
        num_hidden_layers=1, with_tokenizer=False,
    )  # fmt: skip
    quantize_checkpoint_fp8(src, tmp_path / "fp8")
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"

    def change(w):
        w[name] = w[name].repeat(1, 2)

    path = _copy(tmp_path / "fp8", tmp_path / "bad", change)
    for tp_size in (1, 2):
        with pytest.raises(
            ValueError, match=r"o_proj.weight_scale_inv' of shape \(2, 4\) .*expected \(2, 2\)"
        ):
            load_as_runner_on_cuda(path, 0, tp_size)
