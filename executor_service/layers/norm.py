"""RMSNorm, computed in fp32 like Hugging Face's, with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from executor_service.layers.fusable import Fusable


class RMSNorm(Fusable, nn.Module):
    # Fused: one Triton kernel instead of the ops below.
    fused_op = "rms_norm"

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if self.fused and x.dim() == 2:
            from executor_service.layers import triton_ops

            rows = 0
            if self.quantize_for is not None:  # the fp8 GEMM's input, quantized here
                dtype = torch.promote_types(x.dtype, self.weight.dtype)
                if triton_ops.fusable_quantization(x, x.shape[1], dtype):
                    rows = self.quantize_rows_multiple(x.shape[0], dtype, x.device)
            return triton_ops.rms_norm(x, self.weight, self.eps, residual, rows)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
