"""SwiGLU's activation on the packed gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor_service.layers.fusable import Fusable


class SiluAndMul(Fusable, nn.Module):
    # Fused: one Triton kernel instead of three ops.
    fused_op = "silu_and_mul"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from executor_service.layers import triton_ops

            rows = 0
            if self.quantize_for is not None and triton_ops.fusable_quantization(
                x, x.shape[-1] // 2, x.dtype
            ):
                rows = self.quantize_rows_multiple(x.shape[0], x.dtype, x.device)  # the fp8 GEMM's input
            return triton_ops.silu_and_mul(x, rows)
        # x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up
