"""bench/throughput.py: --profile-gpu's accounting of a profiled run (kernel time by group, the time
the device was busy, overlapping kernels counted once, and the gaps between kernels), and the flags
that change this process's fp8 GEMMs."""

from __future__ import annotations

import json
import types

import pytest

torch = pytest.importorskip("torch")

from bench.throughput import apply_fp8_gemm_flags, parse_args, print_gpu_time  # noqa: E402


class _Kernel:
    def __init__(self, name: str, start_us: float, end_us: float) -> None:
        self.name = name
        self.time_range = types.SimpleNamespace(start=start_us, end=end_us)
        self.device_type = torch.autograd.DeviceType.CUDA


def test_busy_time_counts_overlapping_kernels_once_and_gaps_by_length(capsys):
    kernels = [
        _Kernel("paged_attention_kernel", 0, 100),
        _Kernel("nvjet_sm90_gemm", 50, 150),  # overlaps the one before: no gap, 50 us busy more
        _Kernel("_rms_norm_kernel", 155, 160),  # 5 us gap
        _Kernel("store_kv_kernel", 2160, 2200),  # 2 ms gap
    ]
    print_gpu_time(types.SimpleNamespace(events=lambda: kernels), elapsed=0.01, steps=2)
    out = capsys.readouterr().out
    # 100 + 100 + 5 + 40 us of kernels, 195 us of it busy (the overlap once)
    assert "kernels 0.00 s (0.00 s busy" in out
    assert "attention 0.00 s" in out and "gemm 0.00 s" in out
    assert "gaps between kernels 0-10 us: 1, 0.000 s" in out
    assert "gaps between kernels 1000-inf us: 1, 0.002 s" in out
    assert "0.10 ms a step" in out  # 195 us busy over 2 steps
    assert "gap 2.00 ms at 0.000 s: after _rms_norm_kernel, before store_kv_kernel" in out


def test_fp8_gemm_flags_set_the_gemms_of_this_process(tmp_path, monkeypatch, capsys):
    """A sweep's table (bench/fp8_gemm.py --table-out) and the swap rule reach gemm_config, the
    K-halves switch fp8_gemm_triton; the split, whose GEMMs run in the executor's process, refuses
    them."""
    from executor_service.layers import fp8_gemm_triton as g

    monkeypatch.setattr(g, "GEMM_TABLE", dict(g.GEMM_TABLE))
    monkeypatch.setattr(g, "SWAP_MAX_TOKENS", g.SWAP_MAX_TOKENS)
    monkeypatch.setattr(g, "SCALED_MM_SPLIT_K", g.SCALED_MM_SPLIT_K)
    swap = {"KERNEL": "swap", "BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 4, "num_stages": 6, "SPLIT_K": 4}
    table = tmp_path / "table.json"
    table.write_text(json.dumps([[16, 6144, 4096, swap]]))
    apply_fp8_gemm_flags(parse_args(["--mode", "in-process", "--fp8-gemm-table", str(table)]))
    assert g.gemm_config(9, 6144, 4096) == swap and g.gemm_config(8, 6144, 4096) != swap
    assert g.gemm_config(9, 4096, 4096) != swap and "GEMM_TABLE[16, 6144, 4096]" in capsys.readouterr().out
    apply_fp8_gemm_flags(parse_args(["--mode", "in-process", "--fp8-gemm-swap-below", "64"]))
    assert g.gemm_config(64, 4096, 12288)["KERNEL"] == "swap" and "KERNEL" not in g.gemm_config(65, 4096)
    table.write_text(json.dumps([[24, 6144, 4096, swap]]))
    with pytest.raises(SystemExit, match="24 is not a token bucket"):
        apply_fp8_gemm_flags(parse_args(["--mode", "in-process", "--fp8-gemm-table", str(table)]))
    assert not g.SCALED_MM_SPLIT_K
    apply_fp8_gemm_flags(parse_args(["--mode", "in-process", "--fp8-scaled-mm-split-k"]))
    assert g.SCALED_MM_SPLIT_K and "two K halves on two streams" in capsys.readouterr().out
    for flag in (["--fp8-gemm-swap-below", "64"], ["--fp8-scaled-mm-split-k"]):
        with pytest.raises(SystemExit):
            parse_args(["--mode", "split", *flag])
        assert "they need --mode in-process" in capsys.readouterr().err
