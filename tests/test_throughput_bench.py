"""bench/throughput.py --profile-gpu's accounting of a profiled run: kernel time by group, the time
the device was busy (overlapping kernels counted once) and the gaps between kernels."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

from bench.throughput import print_gpu_time  # noqa: E402


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
