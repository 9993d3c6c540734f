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


def test_each_rate_draws_prompts_of_its_own(monkeypatch):
    """Rates run one after another on one service: were their prompts the same, every rate after the
    first would find them in the prefix cache and time cached prefills. The shared prefix stays."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    import serve

    args = serve.parse_args(["--num-requests", "8", "--shared-prefix", "16", "--request-rate", "8", "24"])
    first, second, warm = (serve.make_requests(args, 1000, draw) for draw in (0, 1, serve.WARM_UP_DRAW))
    assert [r.prompt_token_ids[:16] for r in first + second + warm] == [first[0].prompt_token_ids[:16]] * 24
    tails = [tuple(r.prompt_token_ids[16:]) for r in first + second + warm]
    assert len(set(tails)) == 24
    assert serve.make_requests(args, 1000, 0) == first  # a draw is reproducible
