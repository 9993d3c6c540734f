"""Programmatic Dependent Launch (PDL) for the step's Triton kernels, on Hopper and later GPUs.

A kernel launched with PDL may start while the kernel before it on the stream still runs: its
programs take their SM slots and load what no kernel of the step writes (positions, slot mappings,
block tables, weights), then wait (`griddepcontrol.wait`) until the previous grid has finished and
its writes are visible. Under CUDA graphs that hides most of the gap a kernel boundary costs
(about 0.8 us on the H200, several hundred boundaries a decode step) and the previous kernel's tail.

The rules every kernel here keeps, so that the overlap never reads or overwrites live data:

- before `pdl_wait`: loads only of what the host copied in before the step or what the model keeps
  (never an activation, never the KV cache), no store, no return;
- `pdl_wait` also lets the next kernel launch (`griddepcontrol.launch_dependents`), and only after
  the wait: so when a kernel's dependants start, every kernel before it has finished, and one
  waiting kernel at most overlaps a running one.

A kernel that its predecessor does not release (cuBLAS, torch's own) starts when it ends, as
without PDL. `TANDEM_PDL=0` turns PDL off (the kernels then wait on nothing), for comparisons.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton before PDL (3.3): launched without it
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the previous kernel of the stream to finish, then let the next one launch (PDL only;
    nothing without it)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.cache
def _device_supports_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_launch(x: torch.Tensor) -> dict:
    """The launch options of a kernel with a `PDL` constexpr that calls pdl_wait, for a launch on x's
    device: PDL on a CUDA device of compute capability 9.0 or later (not under Triton's
    interpreter, nor with TANDEM_PDL=0), nothing otherwise."""
    if (
        gdc_wait is None
        or not x.is_cuda
        or os.environ.get("TRITON_INTERPRET") == "1"
        or os.environ.get("TANDEM_PDL", "1") == "0"
        or not _device_supports_pdl(
            x.device.index if x.device.index is not None else torch.cuda.current_device()
        )
    ):
        return {}
    return {"PDL": True, "launch_pdl": True}
