"""bench/serve.py (BENCH.md W2) on the CPU with the embedded model: it starts both services, streams
a few requests from 2 client processes, and its JSON has every figure, with counts that add up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

LATENCY_KEYS = [f"{s}_{k}_ms" for k in ("ttft", "tpot", "itl", "e2e") for s in ("mean", "p50", "p90", "p99")]


def test_serve_bench_json(tmp_path):
    out = tmp_path / "serve.json"
    argv = [sys.executable, str(REPO_ROOT / "bench" / "serve.py"), "--num-requests", "6"]
    argv += ["--input-len", "12", "--output-len", "4", "--shared-prefix", "32", "--request-rate", "100"]
    argv += ["--num-processes", "2", "--warm-up", "1", "--goodput", "e2e:600000", "--json", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [run] = json.loads(out.read_text())["runs"]
    for key in [*LATENCY_KEYS, "request_throughput", "output_throughput", "goodput", "duration_s"]:
        assert isinstance(run[key], float) and run[key] >= 0, key
    assert run["num_requests"] == 6 and run["completed"] == 6 and run["failed"] == 0
    assert run["total_output_tokens"] == 6 * 4
    assert run["total_input_tokens"] == 6 * (32 + 12)
    assert run["goodput"] == pytest.approx(run["request_throughput"])  # a 10-minute SLO: all good
    for k in ("ttft", "tpot", "itl", "e2e"):
        assert run[f"p50_{k}_ms"] <= run[f"p90_{k}_ms"] <= run[f"p99_{k}_ms"]
    assert run["p99_ttft_ms"] <= run["p99_e2e_ms"]
    # 5 of the 6 prompts (and the warm-up's) repeat the 32-token prefix: two blocks of 16 hit.
    assert run["prefix_cache_hit_rate"] > 0.3
    assert len(run["client_processes"]) == 2
    assert all(c["cpu_s"] > 0 for c in run["client_processes"])
