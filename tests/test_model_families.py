"""Every supported family against transformers, on tiny checkpoints built through transformers' own
config classes (tests/checkpoints.py FAMILIES): greedy fp32 generation token-identical, through
chunked prefill, prefix-cache hits and preemption in one run; logits step by step; the CLI; and
what is refused, refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from checkpoints import FAMILIES
from executor_fixtures import MiniScheduler, hf_logits, make_executor, prompt_ids
from helpers.families import PROMPT_SEEDS, waves
from helpers.hf_reference import MAX_NEW, _hf_model, assert_matches_hf, make_prompts

from client.llm import LLM
from scheduler_service.sampling_params import SamplingParams

# Starts service processes or runs models at length: left out of `make test-fast`.
pytestmark = pytest.mark.slow

# The prompt seed per family: every compared step has a clear top-1 margin (test_generate_vs_hf).
ATOL = 1e-4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers(family_checkpoint, family):
    """A 32-token budget chunks the long prompts, 10 blocks of 16 are too few for the first wave
    (preemption), and the second wave finds the shared prefix in the cache."""
    path = family_checkpoint(family)
    first, second = waves(PROMPT_SEEDS[family])
    llm = LLM(
        str(path),
        block_size=16,
        num_kv_blocks=10,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        max_model_len=128,
    )
    params = SamplingParams(max_tokens=MAX_NEW)
    outputs = llm.generate(first, params, use_tqdm=False)
    outputs += llm.generate(second, params, use_tqdm=False)
    stats = llm.engine.scheduler.stats
    assert stats.num_chunked_prefills > 0 and stats.num_preemptions > 0
    assert [o.num_cached_tokens for o in outputs[-3:]] == [32] * 3
    assert_matches_hf(path, first + second, outputs)


@pytest.mark.parametrize("family", ["qwen2", "llama3_rope", "qwen3_moe"])
def test_prefill_and_mixed_decode_logits_match_transformers(family_checkpoint, family):
    """A prefills then decodes; B's prefill joins A's decode: every token's logits match."""
    path = family_checkpoint(family)
    hf = _hf_model(str(path))
    sched = MiniScheduler(make_executor(path, block_size=16, num_kv_blocks=64))
    sched.add(1, prompt_ids(37, seed=1))
    sched.add(2, prompt_ids(21, seed=2))
    _, logits = sched.step({1: 37})
    torch.testing.assert_close(logits, hf_logits(hf, sched.seqs[1].token_ids[:37]), atol=ATOL, rtol=0)
    for step in range(6):
        schedule = sched.decode_all()
        if step == 2:
            schedule[2] = 21
        known = {i: list(sched.seqs[i].token_ids) for i in schedule}
        _, logits = sched.step(schedule)
        for (seq_id, n), row in zip(schedule.items(), logits.split(list(schedule.values())), strict=True):
            torch.testing.assert_close(row, hf_logits(hf, known[seq_id])[-n:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", [*FAMILIES, "qwen3_moe_top8", "qwen2_wide"])
def test_bfloat16_prefill_logits_are_transformers_sdpa_to_the_bit(family_checkpoint, family, tmp_path):
    """In bf16 every family's prefill logits are transformers' (its defaults: sdpa attention,
    grouped_mm experts) to the bit: the norms, rotary, attention, MLP, biases, router, experts and
    LM head round where transformers' do. qwen3_moe_top8: 8 of 32 experts per token (at top 2 one
    bf16 add of the two pairs rounds the same in any order). qwen2_wide: hidden 512 and a prompt of
    500 tokens, where one packed q/k/v or gate/up GEMM sums in another order than transformers'
    separate projections (the CPU's GEMM follows the output's width)."""
    from checkpoints import build_checkpoint
    from transformers import AutoModelForCausalLM

    num_tokens = 40
    if family == "qwen3_moe_top8":
        path = build_checkpoint(
            tmp_path, "qwen3_moe", with_tokenizer=False, num_experts=32, num_experts_per_tok=8
        )
    elif family == "qwen2_wide":
        num_tokens = 500
        path = build_checkpoint(
            tmp_path, "qwen2", with_tokenizer=False, hidden_size=512, intermediate_size=1024,
            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
            initializer_range=0.05,
        )  # fmt: skip
    else:
        path = family_checkpoint(family)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    sched = MiniScheduler(make_executor(path, dtype="bfloat16", block_size=16, num_kv_blocks=64))
    prompt = prompt_ids(num_tokens, seed=3)
    sched.add(1, prompt)
    _, logits = sched.step({1: num_tokens})
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    assert logits.dtype == want.dtype == torch.bfloat16
    assert torch.equal(logits, want), f"{(logits != want).float().mean():.1%} of the logits differ"


@pytest.mark.parametrize("family", ["qwen3_moe", "llama_tied"])
def test_cli_generate_matches_transformers(family_checkpoint, family):
    path = family_checkpoint(family)
    prompts = make_prompts([4, 11], seed=PROMPT_SEEDS[family])
    args = [sys.executable, "-m", "client.cli", "generate", "--model", str(path), "--json"]
    args += ["--max-tokens", str(MAX_NEW)]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    outputs = [json.loads(line) for line in proc.stdout.splitlines()]
    for prompt, out in zip(prompts, outputs, strict=True):
        model = _hf_model(str(path))
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW)
        assert out["token_ids"] == ref[0, len(prompt) :].tolist()


def _edited_copy(src, dst, **changes):
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_hidden_act_swish_is_served_as_silu(family_checkpoint, tmp_path):
    """transformers' "swish" is SiLU under another name (some Llama-family configs say it): served,
    and the same tokens as transformers'; it was refused."""
    path = _edited_copy(family_checkpoint("llama_tied"), tmp_path, hidden_act="swish")
    prompts = make_prompts([5, 17], seed=PROMPT_SEEDS["llama_tied"])
    llm = LLM(str(path), block_size=16, num_kv_blocks=32, max_num_seqs=4, max_model_len=128)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW), use_tqdm=False)
    assert_matches_hf(path, prompts, outputs)


def test_a_tied_config_with_a_different_stored_head_is_served_untied(family_checkpoint, tmp_path):
    """config.json ties the head, but the checkpoint stores an lm_head.weight unlike the embeddings:
    transformers serves the stored head (untied, with a warning), and so does tandem. A stored
    head equal to the embeddings stays tied (one tensor in memory)."""
    from safetensors.torch import load_file, save_file

    from executor_service.loader import checkpoint_tensor_files, head_is_tied

    path = _edited_copy(family_checkpoint("qwen2"), tmp_path, tie_word_embeddings=True)
    assert not head_is_tied(checkpoint_tensor_files(path), tie_word_embeddings=True)
    prompts = make_prompts([5, 17, 40], seed=PROMPT_SEEDS["qwen2"])
    options = dict(
        block_size=16, num_kv_blocks=32, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=128
    )
    llm = LLM(str(path), **options)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW), use_tqdm=False)
    assert_matches_hf(path, prompts, outputs)
    same = tmp_path / "same"
    same.mkdir()
    weights = load_file(path / "model.safetensors")
    save_file(
        {**weights, "lm_head.weight": weights["model.embed_tokens.weight"].clone()}, same / "x.safetensors"
    )
    assert head_is_tied(checkpoint_tensor_files(same), tie_word_embeddings=True)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            "architecture 'GPT2LMHeadModel' is not supported; supported: ",
        ),
        (
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
            "rope_type 'longrope' in .*config.json is not supported; supported: default, linear",
        ),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_cli_refuses_in_one_line(family_checkpoint, tmp_path, changes, message):
    path = _edited_copy(family_checkpoint("llama_tied"), tmp_path, **changes)
    args = [sys.executable, "-m", "client.cli", "generate", "--model", str(path), "--prompt-ids", "1,2"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert __import__("re").search(message, lines[0]), lines[0]


def test_sliding_window_caps_max_model_len_and_refuses_beyond(family_checkpoint, tmp_path):
    from executor_service.config import ExecutorConfig

    path = _edited_copy(family_checkpoint("mistral"), tmp_path, sliding_window=64)
    assert ExecutorConfig(model=str(path), num_kv_blocks=16).max_model_len == 64
    with pytest.raises(
        ValueError, match=r"sliding window of 64 .*max_model_len \(128\) must be <= sliding_window"
    ):
        ExecutorConfig(model=str(path), num_kv_blocks=16, max_model_len=128)


@pytest.mark.parametrize(
    ("family", "window"),
    [("mistral", {}), ("qwen2", {"use_sliding_window": True, "max_window_layers": 2})],
    ids=["mistral", "qwen2-layers-2-3"],
)
def test_requests_up_to_the_sliding_window_match_transformers(tmp_path, family, window):
    """A window of 24 (Qwen2: on layers 2 and 3 only) caps max_model_len at 24: requests that end
    exactly there, prefilled in chunks of 8, equal transformers' windowed attention."""
    from checkpoints import build_checkpoint

    path = build_checkpoint(tmp_path, family, with_tokenizer=False, sliding_window=24, **window)
    llm = LLM(str(path), num_kv_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    assert llm.engine.limits.max_model_len == 24
    prompts = make_prompts([1, 9, 20, 23], seed=0)
    hf = _hf_model(str(path))
    for prompt in prompts:
        n = 24 - len(prompt)
        out = llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True), use_tqdm=False)[0]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n)
        assert out.token_ids == ref[0, len(prompt) :].tolist(), len(prompt)
    assert llm.engine.scheduler.stats.num_chunked_prefills > 0
