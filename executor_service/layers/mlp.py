"""The dense SwiGLU MLP: gate and up in one column-parallel matmul, SiLU-and-mul, row-parallel down."""

from __future__ import annotations

import torch
from torch import nn

from executor_service.layers.activation import SiluAndMul
from executor_service.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class DenseMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool, tp_rank: int, tp_size: int
    ) -> None:
        super().__init__()
        size = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [size, size], bias, tp_rank, tp_size)
        self.down_proj = RowParallelLinear(size, hidden_size, bias, tp_rank, tp_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
