"""Linear layers for tensor parallelism: column-parallel (output features split, no
communication) and row-parallel (input features split, partial outputs all-reduced).

Each parameter carries a `weight_loader(param, loaded_weight[, shard_id])` that copies this rank's
slice of a checkpoint tensor, so packed layers (q/k/v, gate/up) load from separate tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor_service.loader import CheckpointSlice, read_tensor
from executor_service.parallel import all_reduce, kv_head_shard, num_kv_heads_per_rank


class LinearBase(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_dim: int | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _shard(self, loaded: torch.Tensor, dim: int, size: int, index: int | None = None) -> torch.Tensor:
        """Slice `index` (default this rank's) of `size` along `dim`; `loaded` may be a lazy
        safetensors slice, so only this rank's part is read from the checkpoint."""
        return loaded.narrow(dim, (self.tp_rank if index is None else index) * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | CheckpointSlice) -> None:
        if self.tp_dim is not None and self.tp_dim < loaded.dim():
            loaded = self._shard(loaded, self.tp_dim, param.shape[self.tp_dim])
        _copy(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _copy(dst: torch.Tensor, src: torch.Tensor | CheckpointSlice) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(dst.shape)}, checkpoint {tuple(src.shape)}")
    dst.copy_(read_tensor(src))


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication after the matmul."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        if output_size % tp_size:
            raise ValueError(f"output size {output_size} is not divisible by tp_size {tp_size}")
        super().__init__(input_size, output_size // tp_size, bias, 0, tp_rank, tp_size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_proj and up_proj -> gate_up_proj)."""

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        _copy(param.data.narrow(0, offset, size), self._shard(loaded, 0, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q_proj, k_proj and v_proj in one matmul; heads split across ranks. With more ranks than
    KV heads, each rank holds the one KV head its query heads use (replicated across ranks)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = num_kv_heads_per_rank(num_kv_heads, tp_size)
        self.kv_shard = kv_head_shard(tp_rank, num_kv_heads, tp_size)
        output_size = (num_heads + 2 * self.num_kv_heads * tp_size) * head_dim
        super().__init__(hidden_size, output_size, bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        index = self.tp_rank if shard_id == "q" else self.kv_shard
        _copy(param.data.narrow(0, offset, size), self._shard(loaded, 0, size, index))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial outputs are all-reduced."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        if input_size % tp_size:
            raise ValueError(f"input size {input_size} is not divisible by tp_size {tp_size}")
        super().__init__(input_size // tp_size, output_size, bias, 1, tp_rank, tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, by rank 0, before the sum over ranks.
        y = F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        return all_reduce(y) if self.tp_size > 1 else y
