"""Our Qwen3 through LocalExecutor against Hugging Face transformers on the same checkpoints."""

from __future__ import annotations

import itertools
import json
import shutil

import pytest
import torch
from executor_fixtures import MiniScheduler, hf_logits, make_executor, prompt_ids
from transformers import Qwen3ForCausalLM

ATOL = 1e-4


@pytest.fixture(params=["qwen3_tied", "qwen3_untied"])
def checkpoint(request):
    return request.getfixturevalue(request.param)


def _hf(path, dtype=torch.float32):
    return Qwen3ForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.mark.parametrize("block_size", [16, 256])
def test_prefill_and_mixed_decode_match_transformers(checkpoint, block_size):
    """Two sequences: A prefills then decodes; B joins mid-way, so its prefill shares a step
    with A's decode. Every scheduled token's logits match HF, and greedy tokens equal HF's argmax."""
    hf = _hf(checkpoint)
    sched = MiniScheduler(make_executor(checkpoint, block_size=block_size, num_kv_blocks=4096 // block_size))
    sched.add(1, prompt_ids(37, seed=1))
    sched.add(2, prompt_ids(21, seed=2))

    _, logits = sched.step({1: 37})
    torch.testing.assert_close(logits, hf_logits(hf, sched.seqs[1].token_ids[:37]), atol=ATOL, rtol=0)
    for step in range(12):
        schedule = sched.decode_all()
        if step == 3:
            schedule[2] = 21
        known = {i: list(sched.seqs[i].token_ids) for i in schedule}
        _, logits = sched.step(schedule)
        rows = logits.split(list(schedule.values()))
        for (seq_id, n), row in zip(schedule.items(), rows, strict=True):
            ref = hf_logits(hf, known[seq_id])[-n:]
            torch.testing.assert_close(row, ref, atol=ATOL, rtol=0)
            assert sched.seqs[seq_id].token_ids[-1] == ref[-1].argmax().item()
    assert len(sched.seqs[1].token_ids) == 37 + 13
    assert len(sched.seqs[2].token_ids) == 21 + 9


@pytest.mark.parametrize("chunks", [[16, 20, 14], [1, 48, 1], [50]])
def test_chunked_prefill_equals_one_shot(qwen3_untied, chunks):
    prompt = prompt_ids(50, seed=3)
    one = MiniScheduler(make_executor(qwen3_untied))
    one.add(1, prompt)
    _, one_shot = one.step({1: 50})

    sched = MiniScheduler(make_executor(qwen3_untied))
    sched.add(1, prompt)
    pieces = []
    for i, n in enumerate(chunks):
        result, logits = sched.step({1: n})
        pieces.append(logits)
        # A chunk that does not finish the prompt samples nothing.
        assert result.seq_ids == ([1] if i == len(chunks) - 1 else [])
    torch.testing.assert_close(torch.cat(pieces), one_shot, atol=ATOL, rtol=0)
    assert sched.seqs[1].token_ids == one.seqs[1].token_ids


def test_prefix_cache_hit_reuses_blocks(qwen3_tied):
    """B shares A's first two full blocks (num_computed_tokens 32) and computes only its suffix."""
    hf = _hf(qwen3_tied)
    sched = MiniScheduler(make_executor(qwen3_tied, block_size=16))
    prefix = prompt_ids(32, seed=4)
    sched.add(1, [*prefix, 7, 8, 9])
    sched.step({1: 35})
    b_prompt = [*prefix, 100, 101, 102, 103, 104]
    sched.add(2, b_prompt, shared_blocks=sched.seqs[1].block_table[:2], num_computed_tokens=32)
    _, logits = sched.step({2: 5})
    torch.testing.assert_close(logits, hf_logits(hf, b_prompt)[32:], atol=ATOL, rtol=0)


def test_production_step_computes_logits_only_for_sampling_tokens(qwen3_tied, monkeypatch):
    executor = make_executor(qwen3_tied)
    model = executor.runner.model
    shapes = []

    def spy(hidden):
        shapes.append(tuple(hidden.shape))
        return type(model).compute_logits(model, hidden)

    monkeypatch.setattr(model, "compute_logits", spy)
    sched = MiniScheduler(executor)
    sched.add(1, prompt_ids(20, seed=5))
    sched.add(2, prompt_ids(30, seed=6))
    plan = sched.plan({1: 20, 2: 10})
    sched.update(plan, executor.step(plan))
    # Seq 1 decodes; seq 2's next chunk does not finish its prompt: 11 tokens, one row of logits.
    plan = sched.plan({1: 1, 2: 10})
    result = executor.step(plan)
    assert result.seq_ids == [1]
    assert shapes == [(1, 64), (1, 64)]


def test_sharded_checkpoint_loads_like_single_file(qwen3_untied, tmp_path):
    hf = _hf(qwen3_untied)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_text((qwen3_untied / name).read_text())
    assert len(list(tmp_path.glob("*.safetensors"))) > 3
    assert (tmp_path / "model.safetensors.index.json").exists()
    sched = MiniScheduler(make_executor(tmp_path))
    prompt = prompt_ids(25, seed=7)
    sched.add(1, prompt)
    _, logits = sched.step({1: 25})
    torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=ATOL, rtol=0)


def test_bfloat16_load_via_dtype_flag(qwen3_tied):
    executor = make_executor(qwen3_tied, dtype="bfloat16")
    info = executor.describe()
    assert info.dtype == "bfloat16"
    assert info.block_bytes == 2 * 4 * 16 * 2 * 16 * 2
    assert all(p.dtype == torch.bfloat16 for p in executor.runner.model.parameters())
    hf = _hf(qwen3_tied, dtype=torch.bfloat16)
    sched = MiniScheduler(executor)
    prompt = prompt_ids(30, seed=8)
    sched.add(1, prompt)
    _, logits = sched.step({1: 30})
    ref = hf_logits(hf, prompt)
    # bf16 keeps ~3 significant digits; the logits span about +-20.
    torch.testing.assert_close(logits.float(), ref, atol=0.25, rtol=0.02)
    assert (logits.float().argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_bfloat16_logits_are_transformers_sdpa_to_the_bit(qwen3_tied):
    """In bf16, the prefill's and every decode step's logits are transformers' (its default sdpa
    attention, generating with its KV cache) to the bit: every op rounds where transformers' does."""
    hf = Qwen3ForCausalLM.from_pretrained(qwen3_tied, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    sched = MiniScheduler(make_executor(qwen3_tied, dtype="bfloat16"))
    prompt = prompt_ids(45, seed=8)
    sched.add(1, prompt)
    _, logits = sched.step({1: 45})
    rows = [logits[-1]]
    for _ in range(7):
        _, logits = sched.step(sched.decode_all())
        rows.append(logits[-1])
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    assert sched.seqs[1].token_ids[45:] == out.sequences[0, 45:].tolist()
    for step, (ours, want) in enumerate(zip(rows, out.logits, strict=True)):
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, want[0]), f"step {step}"


def test_older_config_format_with_top_level_rope_theta(qwen3_untied, tmp_path):
    """Configs written before transformers 5 carry rope_theta and torch_dtype at the top level."""
    for f in qwen3_untied.iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((qwen3_untied / "config.json").read_text())
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config["torch_dtype"] = config.pop("dtype")
    (tmp_path / "config.json").write_text(json.dumps(config))
    executor = make_executor(tmp_path)
    assert executor.config.model_config.rope_theta == 1e6
    assert executor.describe().dtype == "float32"
    sched = MiniScheduler(executor)
    prompt = prompt_ids(40, seed=9)
    sched.add(1, prompt)
    _, logits = sched.step({1: 40})
    torch.testing.assert_close(logits, hf_logits(_hf(qwen3_untied), prompt), atol=ATOL, rtol=0)


def test_kernel_warm_up_leaves_no_trace(qwen3_untied):
    """The start-up warm-up (run on CUDA; here through the torch backend) writes garbage K/V into
    cache blocks that serving then hands out: a request on those blocks still matches transformers,
    and the runner holds no warm-up sequence afterwards."""
    from executor_service.kernel_warmup import warm_up_kernels, warm_up_steps

    steps = warm_up_steps(16, [1, 2, 5], decode_only=True)
    chunk_alone, mixed_at_2, mixed_at_5 = steps[0], steps[2], steps[4]
    assert len(chunk_alone) == 1 and 1 < chunk_alone[0][1] < chunk_alone[0][0] - 1, "a chunk after a prefix"
    assert [length - done for length, done in mixed_at_5] == [
        1,
        1,
        1,
        1,
        chunk_alone[0][0] - chunk_alone[0][1],
    ]
    assert len(mixed_at_2) == 2 and [len(s) for s in steps if all(n - d == 1 for n, d in s)] == [1, 2, 5]

    # A max_model_len shorter than the warm-up's chunk step: that step is left out, nothing fails.
    short = make_executor(qwen3_untied, num_kv_blocks=64, max_model_len=32, block_size=16).runner
    assert warm_up_kernels(short, 64) == len(warm_up_steps(16, [2], decode_only=True)) - 2
    assert (short.block_tables.lengths == 0).all()

    hf = _hf(qwen3_untied)
    executor = make_executor(qwen3_untied, num_kv_blocks=64)
    runner = executor.runner
    assert warm_up_kernels(runner, 64) == len(warm_up_steps(runner.block_size, [2], decode_only=True))
    assert (runner.block_tables.lengths == 0).all(), "a warm-up sequence kept its block-table row"
    sched = MiniScheduler(executor)
    sched.add(1, prompt_ids(40, seed=4))  # blocks 0-2 of the cache: all written by the warm-up
    _, logits = sched.step({1: 40})
    torch.testing.assert_close(logits, hf_logits(hf, sched.seqs[1].token_ids[:40]), atol=ATOL, rtol=0)
    for _ in range(4):
        known = list(sched.seqs[1].token_ids)
        _, logits = sched.step(sched.decode_all())
        torch.testing.assert_close(logits, hf_logits(hf, known)[-1:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 5, 6])
def test_step_tensors_start_on_16_byte_boundaries(qwen3_tied, num_seqs):
    """Triton compiles a kernel variant per alignment of each pointer argument: the per-step tensors,
    views of one host-to-device copy, must all be aligned whatever the batch size, and hold their
    own values (not a neighbour's, shifted by the padding)."""
    from executor_service.sequence import SequenceState
    from protos.plan import StepSamplingParams

    runner = make_executor(qwen3_tied).runner
    lengths = [3 + 7 * i for i in range(num_seqs)]
    seqs, next_block = [], 0
    for i, length in enumerate(lengths):
        table = list(range(next_block, next_block + -(-length // runner.block_size)))
        next_block += len(table)
        computed = length - 1 if i % 2 else 0  # decode rows between prompts
        seqs.append(
            SequenceState(i, list(range(1, length + 1)), table, computed, StepSamplingParams(), length)
        )
        runner.add_sequence(seqs[-1])
    scheduled = [length - s.num_computed_tokens for length, s in zip(lengths, seqs, strict=True)]
    batch = runner.prepare(seqs, scheduled)
    ctx = batch.context
    named = {
        "input_ids": batch.input_ids,
        "positions": batch.positions,
        "logits_indices": batch.logits_indices,
        "slot_mapping": ctx.slot_mapping,
        "context_lens": ctx.context_lens,
        "cu_seqlens_q": ctx.cu_seqlens_q,
        "cu_seqlens_k": ctx.cu_seqlens_k,
        "block_tables": ctx.block_tables,
        "seq_order": ctx.seq_order,
    }
    for name, tensor in named.items():
        assert tensor.storage_offset() * tensor.element_size() % 16 == 0, f"{name} is not 16-byte aligned"
    assert ctx.context_lens.tolist() == lengths
    # The decode kernel's programs take the longest contexts first.
    assert ctx.seq_order.tolist() == sorted(range(num_seqs), key=lambda i: -lengths[i])
    assert ctx.cu_seqlens_q.tolist() == [0, *itertools.accumulate(scheduled)]
    assert ctx.cu_seqlens_k.tolist() == [0, *itertools.accumulate(lengths)]
    assert batch.logits_indices.tolist() == [end - 1 for end in itertools.accumulate(scheduled)]
    for row, seq in zip(ctx.block_tables.tolist(), seqs, strict=True):
        assert row[: len(seq.block_table)] == seq.block_table
    expected_ids = [
        t for s, n in zip(seqs, scheduled, strict=True) for t in s.token_ids[s.num_computed_tokens :][:n]
    ]
    assert batch.input_ids.tolist() == expected_ids
