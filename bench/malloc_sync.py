"""Whether a new cudaMalloc holds the host until the device is idle: the host time of the LM head's
F.linear (Qwen3-0.6B's [151936, 1024] bf16 weight) at row counts W1's prefill steps sample, on an idle
device, behind ~40 ms of queued GEMMs, and behind them again with the card's memory nearly taken
(new row counts: the caching allocator has no block to split, so it asks the driver for a segment).

    python bench/malloc_sync.py

bench/throughput.py prints the segments its timed in-process run took from the driver, and
`--allocator-reserve-mb N` gives the caching allocator a block of N MiB to split first.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def host_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    dev = "cuda"
    head = torch.randn(151936, 1024, device=dev, dtype=torch.bfloat16)
    big = torch.randn(16384, 1024, device=dev, dtype=torch.bfloat16)
    gate_up = torch.randn(6144, 1024, device=dev, dtype=torch.bfloat16)

    def busy() -> None:  # ~40 ms of GEMMs queued on the device
        for _ in range(160):
            F.linear(big, gate_up)

    def linear_then_sync(label: str, rows: int, before=None) -> None:
        x = torch.randn(rows, 1024, device=dev, dtype=torch.bfloat16)
        torch.cuda.synchronize()
        if before is not None:
            before()
        launch = host_ms(lambda: F.linear(x, head))
        wait = host_ms(torch.cuda.synchronize)
        print(
            f"{label} rows {rows}: F.linear's host time {launch:.2f} ms, then the sync {wait:.2f} ms",
            flush=True,
        )

    torch.cuda.synchronize()
    for label, before in (("idle", None), ("behind queued GEMMs", busy)):
        for rows in (37, 66, 94, 124, 152, 37, 66):  # the first call of each count allocates
            linear_then_sync(label, rows, before)
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(int(free - 1.5e9), dtype=torch.uint8, device=dev)  # noqa: F841 (held)
    print(f"memory taken: {torch.cuda.mem_get_info()[0] / 1e9:.1f} GB left", flush=True)
    for rows in (183, 214, 241, 256, 300, 183):
        linear_then_sync("behind queued GEMMs, memory taken,", rows, busy)


if __name__ == "__main__":
    main()
