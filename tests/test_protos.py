"""The committed protobuf stubs match the .proto sources, and the wire conversion is lossless."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from protos import plan
from protos.tandem.v1 import executor_pb2

ROOT = Path(__file__).resolve().parents[1]


def test_generated_stubs_are_current():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "protos" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr


def test_stale_stub_is_detected(tmp_path, monkeypatch):
    """The check must fail when a .proto changes without regenerating."""
    sys.path.insert(0, str(ROOT / "protos"))
    import generate

    proto_dir = tmp_path / "tandem" / "v1"
    proto_dir.mkdir(parents=True)
    for f in (ROOT / "protos" / "tandem" / "v1").iterdir():
        if f.suffix in (".proto", ".py", ".pyi"):
            (proto_dir / f.name).write_text(f.read_text())
    source = proto_dir / "executor.proto"
    source.write_text(
        source.read_text().replace("int32 block_size = 3;", "int32 block_size = 3;\n  int32 extra = 99;")
    )
    monkeypatch.setattr(generate, "PROTO_ROOT", tmp_path)
    monkeypatch.setattr(generate, "PROTO_DIR", proto_dir)
    monkeypatch.setattr(sys, "argv", ["generate.py", "--check"])
    assert generate.main() == 1


def test_plan_round_trips_through_protobuf():
    original = plan.StepPlan(
        step_id=7,
        new_seqs=[
            plan.NewSequence(
                seq_id=3,
                token_ids=[5, 6, 7],
                block_table=[9],
                num_computed_tokens=0,
                sampling_params=plan.StepSamplingParams(
                    temperature=0.5, top_k=4, seed=11, num_prompt_tokens=3
                ),
            ),
            plan.NewSequence(4, [1], [2], 0, plan.StepSamplingParams()),
            plan.NewSequence(
                5,
                [1, 2],
                [3],
                0,
                plan.StepSamplingParams(
                    min_tokens=4,
                    stop_token_ids=[0, 9],
                    logit_bias_token_ids=[7, 8],
                    logit_bias_values=[100.0, -0.5],
                    prompt_logprobs=0,
                ),
            ),
        ],
        seq_ids=[3, 4, 5, 8],
        num_scheduled_tokens=[3, 1, 2, 1],
        num_computed_tokens=[0, 0, 0, 40],
        new_block_ids=[12],
        num_new_blocks=[0, 0, 0, 1],
        finished_seq_ids=[1],
        preempted_seq_ids=[2],
    )
    wire = plan.plan_to_proto(original).SerializeToString()
    decoded = plan.plan_from_proto(executor_pb2.StepPlan.FromString(wire))
    assert decoded == original
    # An unset seed stays unset (not 0), a set seed of 0 stays 0; so does prompt_logprobs.
    assert decoded.new_seqs[1].sampling_params.seed is None
    assert decoded.new_seqs[1].sampling_params.prompt_logprobs is None
    assert decoded.new_seqs[2].sampling_params.prompt_logprobs == 0
    zero = plan.StepSamplingParams(seed=0)
    assert plan._sampling_from_proto(plan._sampling_to_proto(zero)).seed == 0


def test_result_and_info_round_trip():
    result = plan.StepResult(
        step_id=7,
        seq_ids=[3, 8],
        token_ids=[10, 11],
        num_tokens=[1, 1],
        logprobs=[plan.TokenLogprobs(3, [-0.5], [10, 2], [-0.5, -1.25])],
        prepare_seconds=0.25,
        forward_seconds=0.5,
        sample_seconds=0.125,
        prompt_logprobs=[plan.PromptLogprobs(3, 1, [-0.5, -2.0], [1, 4], [10, 2], [-0.5, -0.75])],
    )
    wire = plan.result_to_proto(result).SerializeToString()
    assert plan.result_from_proto(executor_pb2.StepResult.FromString(wire)) == result
    info = plan.ExecutorInfo(
        "m", "Qwen3ForCausalLM", 16, 100, 1024, 512, [0, 1], 1, "float32", "cpu", 8, 64, "torch", 4, 4096
    )
    assert (
        plan.info_from_proto(
            executor_pb2.DescribeResponse.FromString(plan.info_to_proto(info).SerializeToString())
        )
        == info
    )
