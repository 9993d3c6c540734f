"""SwiGLU's activation on the packed gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up
