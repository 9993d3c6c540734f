"""scheduler_service must import and run with torch and numpy unavailable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import importlib, importlib.abc, pkgutil, sys

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "numpy"):
            raise ImportError(f"import of {name} is blocked: scheduler_service must not need it")
        return None

sys.meta_path.insert(0, Blocker())

import scheduler_service
for module in pkgutil.iter_modules(scheduler_service.__path__):
    importlib.import_module(f"scheduler_service.{module.name}")

from protos.executor import StepOnlyExecutor
from protos.plan import ExecutorInfo, StepResult
from scheduler_service.config import SchedulerConfig
from scheduler_service.engine import LLMEngine
from scheduler_service.sampling_params import SamplingParams

class TinyExecutor(StepOnlyExecutor):
    def __init__(self):
        self.tokens = {}
    def describe(self):
        return ExecutorInfo("tiny", "Tiny", 4, 32, 64, 512, [0], 1, "float32", "cpu", 8, 64, "none", 1, 1)
    def reset(self):
        self.tokens.clear()
        return 0
    def step(self, plan):
        for sid in plan.finished_seq_ids + plan.preempted_seq_ids:
            del self.tokens[sid]
        for s in plan.new_seqs:
            self.tokens[s.seq_id] = [list(s.token_ids), s.num_computed_tokens]
        result = StepResult(step_id=plan.step_id)
        for sid, n in zip(plan.seq_ids, plan.num_scheduled_tokens):
            state = self.tokens[sid]
            state[1] += n
            if state[1] == len(state[0]):
                tok = (state[0][-1] * 31 + 7) % 512
                state[0].append(tok)
                result.seq_ids.append(sid)
                result.token_ids.append(tok)
                result.num_tokens.append(1)
        return result

engine = LLMEngine(TinyExecutor(), SchedulerConfig(max_num_batched_tokens=16))
for i in range(6):
    engine.add_request([3 + i] * (5 + 7 * i), SamplingParams(max_tokens=10, ignore_eos=True))
done = 0
while engine.has_unfinished_requests():
    done += sum(o.finished for o in engine.step())
assert done == 6, done
assert "torch" not in sys.modules and "numpy" not in sys.modules
print("ok", done)
"""


def test_scheduler_service_runs_without_torch():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok", "6"]
