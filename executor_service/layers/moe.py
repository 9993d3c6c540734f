"""The sparse MoE block of Qwen3-MoE: a router (logits in the model dtype as transformers computes
them, softmax in fp32, top-k, optionally renormalised) and the experts, packed per layer into two weights:

    w13_weight [num_experts, 2 * intermediate / tp, hidden]   each expert's gate rows then up rows
    w2_weight  [num_experts, hidden, intermediate / tp]       each expert's down projection

Tensor parallelism splits every expert's intermediate dimension (as vLLM does): each rank computes
all experts on its slice and the partial outputs are all-reduced, like a dense row-parallel MLP. The
loader reads the checkpoint's per-expert tensors (`mlp.experts.E.{gate,up,down}_proj.weight`)
straight into these, each rank only its slice.

Two paths compute the router and the experts: on CUDA the fused Triton kernels (fused_moe_triton.py: tokens sorted
by expert, grouped GEMMs, no host sync, so a decode step is captured in a CUDA graph); elsewhere a
loop over the experts that received tokens, rounding where transformers' default (grouped_mm) experts
do (the CPU path, and the reference the kernels are tested against).

With an fp8 checkpoint and the fused path (CUDA), `to_fp8()` keeps the experts in e4m3 with their
block scales, the fused kernels' W8A8 GEMMs:

    w13_weight_scale_inv [num_experts, 2 * ceil(shard / 128), ceil(hidden / 128)]   gate blocks, then up
    w2_weight_scale_inv  [num_experts, ceil(hidden / 128), ceil(shard / 128)]

and each rank's slice of the intermediate dimension must be whole blocks (refused otherwise). Elsewhere
the loader dequantizes the experts to the compute dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor_service.layers.fusable import Fusable
from executor_service.loader import CheckpointSlice, read_tensor
from executor_service.parallel import all_reduce

# Checkpoint projection name -> which part of the packed weights it fills.
EXPERT_PROJECTIONS = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}


def route(
    hidden_states: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_tokens, hidden] -> (weights [num_tokens, top_k] in the model dtype, expert ids [num_tokens,
    top_k] int64). transformers' Qwen3MoeTopKRouter: the logits a GEMM in the model dtype (rounded to
    it: in bf16 that decides near ties), the softmax, top-k and renormalising in fp32. Experts of
    equal probability (common in bf16) come in torch.topk's order, as transformers'; the fused
    router (fused_moe_triton.route) takes the lower expert first."""
    logits = F.linear(hidden_states, router_weight.to(hidden_states.dtype))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(hidden_states.dtype), ids


def experts_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, k]: a loop
    over the experts hit (it syncs with the host), rounding as transformers' Qwen3MoeExperts does in
    its default experts implementation (grouped_mm, what from_pretrained picks): each pair's output
    times its weight in the model dtype, then a token's k pairs summed in fp32, in slot order, and
    rounded once (as fused_moe_triton.sum_topk). transformers' eager loop instead index_adds each
    expert's products into a model-dtype sum (a rounding per add: in bf16 at top 8, about half the
    outputs a step off)."""
    num_tokens, top_k = topk_ids.shape
    pairs = x.new_zeros(num_tokens, top_k, x.shape[-1])
    for expert in torch.unique(topk_ids).tolist():
        token_idx, slot = torch.where(topk_ids == expert)
        gate, up = F.linear(x[token_idx], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * topk_weights[token_idx, slot, None]
        pairs[token_idx, slot] = y.to(x.dtype)
    return pairs.sum(dim=1)  # in the model dtype: accumulated in fp32, rounded once


class FusedMoE(Fusable, nn.Module):
    fused_op = "fused_moe"

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        if intermediate_size % tp_size:
            raise ValueError(
                f"moe_intermediate_size {intermediate_size} is not divisible by tp_size {tp_size}"
            )
        self.num_experts, self.top_k = num_experts, top_k
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.shard = intermediate_size // tp_size
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * self.shard, hidden_size), requires_grad=False
        )
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.shard), requires_grad=False)
        self.w13_weight.weight_loader = self.w2_weight.weight_loader = self.weight_loader
        self.w13_weight_scale_inv: nn.Parameter | None = None
        self.w2_weight_scale_inv: nn.Parameter | None = None
        self.block = (1, 1)  # elements per scale: (128, 128) once to_fp8

    def to_fp8(self, block: tuple[int, int]) -> None:
        """e4m3 experts + per-block fp32 scales in place of the weights (before loading)."""
        num_experts, _, hidden = self.w13_weight.shape
        shard, (bn, bk) = self.shard, block
        if self.tp_size > 1 and (shard % bn or shard % bk):
            raise ValueError(
                f"this rank's moe_intermediate_size shard of {shard} ({shard * self.tp_size} / "
                f"tensor_parallel_size {self.tp_size}) would split the fp8 checkpoint's blocks of "
                f"{max(bn, bk)}: serve it with a tensor_parallel_size whose shards are multiples of the block"
            )

        def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            p = nn.Parameter(
                torch.empty(shape, dtype=dtype, device=self.w13_weight.device), requires_grad=False
            )
            p.weight_loader = self.weight_loader
            return p

        fp8 = torch.float8_e4m3fn
        self.w13_weight = param(num_experts, 2 * shard, hidden, dtype=fp8)
        self.w2_weight = param(num_experts, hidden, shard, dtype=fp8)
        self.w13_weight_scale_inv = param(
            num_experts, 2 * -(-shard // bn), -(-hidden // bk), dtype=torch.float32
        )
        self.w2_weight_scale_inv = param(num_experts, -(-hidden // bn), -(-shard // bk), dtype=torch.float32)
        self.block = block

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor | CheckpointSlice, shard_id: tuple[int, int]
    ) -> None:
        """shard_id (expert, part): part 0 gate [I, H], 1 up [I, H], 2 down [H, I] of one expert, or
        their weight_scale_inv (in blocks: this rank's start is on a block boundary, to_fp8 checks)."""
        expert, part = shard_id
        scale = param is self.w13_weight_scale_inv or param is self.w2_weight_scale_inv
        unit = (self.block[1] if part == 2 else self.block[0]) if scale else 1
        start, size = self.tp_rank * self.shard // unit, -(-self.shard // unit)
        if part == 2:
            dst, src = param.data[expert], loaded.narrow(1, start, size)
        else:
            dst = param.data[expert].narrow(0, part * size, size)
            src = loaded.narrow(0, start, size)
        if dst.shape != src.shape:
            raise ValueError(
                f"expert {expert} shape mismatch: parameter {tuple(dst.shape)}, checkpoint {tuple(src.shape)}"
            )
        dst.copy_(read_tensor(src))

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        expert_counts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # x: [num_tokens, hidden]; topk_*: [num_tokens, top_k]; expert_counts: the fused router's
        # (fused_moe_triton.route_counts), on the fused path.
        if self.fused:
            from executor_service.layers import fused_moe_triton

            out = fused_moe_triton.fused_experts(
                x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                w13_scale=self.w13_weight_scale_inv, w2_scale=self.w2_weight_scale_inv,
                expert_counts=expert_counts,
            )  # fmt: skip
        else:
            if self.w13_weight_scale_inv is not None:
                raise RuntimeError(
                    "fp8 experts run only on the fused path (the loader dequantizes them otherwise)"
                )
            out = experts_reference(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        return all_reduce(out) if self.tp_size > 1 else out


class SparseMoeBlock(nn.Module):
    """Router `gate` (replicated on every rank) and the experts."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        norm_topk_prob: bool,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, tp_rank, tp_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.experts.fused:
            from executor_service.layers import fused_moe_triton

            counts = fused_moe_triton.route_counts(
                hidden_states.shape[0], self.gate.weight.shape[0], hidden_states.device
            )
            weights, ids = fused_moe_triton.route(
                hidden_states, self.gate.weight, self.top_k, self.norm_topk_prob, counts=counts
            )
            return self.experts(hidden_states, weights, ids, counts)
        weights, ids = route(hidden_states, self.gate.weight, self.top_k, self.norm_topk_prob)
        return self.experts(hidden_states, weights, ids)
