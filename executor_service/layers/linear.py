"""Linear layers for tensor parallelism: column-parallel (output features split, no
communication) and row-parallel (input features split, partial outputs all-reduced).

Each parameter carries a `weight_loader(param, loaded_weight[, shard_id])` that copies this rank's
slice of a checkpoint tensor, so packed layers (q/k/v, gate/up) load from separate tensors.

`to_fp8()` turns a layer into one of an fp8 checkpoint on CUDA: an e4m3 weight and its
`weight_scale_inv` (one fp32 scale per 128 x 128 block), through the W8A8 GEMM of
fp8_gemm_triton.py. The same loaders then place whole blocks of scales: every shard (a rank's rows
or columns, q/k/v, gate/up) must start and end on a block boundary, or to_fp8 refuses it
(fp8_layers.convert_to_fp8 picks the layers)."""

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
        self.weight_scale_inv: nn.Parameter | None = None
        self.block = (1, 1)  # elements per scale: (128, 128) once to_fp8
        # A packed layer's parts (q/k/v, gate/up): this rank's output rows of each, in order.
        self.part_sizes: list[int] = [output_size]

    def to_fp8(self, block: tuple[int, int]) -> None:
        """e4m3 weight + per-block fp32 scales in place of the weight (before loading)."""
        out_f, in_f = self.weight.shape
        for size, b, what in self._block_sizes(out_f, in_f, block):
            if size % b:
                remedy = (
                    "serve it with a tensor_parallel_size whose shards are multiples of the block"
                    if self.tp_size > 1
                    else "this layer's parts are not whole blocks at any tensor_parallel_size (with "
                    "--quantization fp8: serve the checkpoint unquantized)"
                )
                raise ValueError(f"{what} of {size} would split the fp8 checkpoint's blocks of {b}: {remedy}")
        device = self.weight.device
        self.weight = nn.Parameter(
            torch.empty(out_f, in_f, dtype=torch.float8_e4m3fn, device=device), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        scale = torch.empty(-(-out_f // block[0]), -(-in_f // block[1]), dtype=torch.float32, device=device)
        self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        self.weight_scale_inv.weight_loader = self.weight_loader
        self.block = block

    def _block_sizes(self, out_f: int, in_f: int, block: tuple[int, int]) -> list[tuple[int, int, str]]:
        """(size, block, name) of every shard boundary that must fall on a block boundary."""
        if self.tp_size == 1:
            return []
        dim = self.tp_dim
        return [((out_f, in_f)[dim], block[dim], f"this rank's {('rows', 'columns')[dim]}")]

    def _rows(self, param: nn.Parameter, n: int) -> int:
        """n output rows of the weight in `param`'s units (blocks for weight_scale_inv)."""
        return n // self.block[0] if param is self.weight_scale_inv else n

    def _shard(self, loaded: torch.Tensor, dim: int, size: int, index: int | None = None) -> torch.Tensor:
        """Slice `index` (default this rank's) of `size` along `dim`; `loaded` may be a lazy
        safetensors slice, so only this rank's part is read from the checkpoint."""
        return loaded.narrow(dim, (self.tp_rank if index is None else index) * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | CheckpointSlice) -> None:
        if self.tp_dim is not None and self.tp_dim < loaded.dim():
            loaded = self._shard(loaded, self.tp_dim, param.shape[self.tp_dim])
        _copy(param.data, loaded)

    def matmul(self, x, bias: torch.Tensor | None) -> torch.Tensor:
        """x: a tensor, or for an fp8 layer an Fp8Input already quantized (by the op before). On the
        CPU a packed layer multiplies part by part, as transformers' separate projections do: the
        CPU's GEMM sums in an order that follows the output's width, so one packed product differs
        from transformers' q, k and v (or gate and up) in a few elements in 10^4 (bf16 and fp32)."""
        if self.weight_scale_inv is None:
            if len(self.part_sizes) > 1 and self.weight.device.type == "cpu":
                weights = self.weight.split(self.part_sizes)
                biases = bias.split(self.part_sizes) if bias is not None else [None] * len(weights)
                return torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)], dim=-1)
            return F.linear(x, self.weight, bias)
        from executor_service.layers.fp8_gemm_triton import fp8_linear

        y = fp8_linear(x, self.weight, self.weight_scale_inv)
        return y if bias is None else y + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


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
        self.part_sizes = [n // tp_size for n in output_sizes]

    def _block_sizes(self, out_f: int, in_f: int, block: tuple[int, int]) -> list[tuple[int, int, str]]:
        return [
            (n // self.tp_size, block[0], f"output shard {i}'s rows") for i, n in enumerate(self.output_sizes)
        ]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        offset = self._rows(param, sum(self.output_sizes[:shard_id]) // self.tp_size)
        size = self._rows(param, self.output_sizes[shard_id] // self.tp_size)
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
        kv = self.num_kv_heads * head_dim
        self.part_sizes = [self.num_heads * head_dim, kv, kv]

    def _block_sizes(self, out_f: int, in_f: int, block: tuple[int, int]) -> list[tuple[int, int, str]]:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [(q, block[0], "this rank's q rows"), (kv, block[0], "this rank's k and v rows")]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size = self._rows(param, self.num_heads * self.head_dim)
        kv_size = self._rows(param, self.num_kv_heads * self.head_dim)
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
        y = self.matmul(x, self.bias if self.tp_rank == 0 else None)
        return all_reduce(y) if self.tp_size > 1 else y
