"""The sparse MoE block of Qwen3-MoE: a router (logits and softmax in fp32, top-k, optionally
renormalised) and the experts, packed per layer into two weights:

    w13_weight [num_experts, 2 * intermediate / tp, hidden]   each expert's gate rows then up rows
    w2_weight  [num_experts, hidden, intermediate / tp]       each expert's down projection

Tensor parallelism splits every expert's intermediate dimension (as vLLM does): each rank computes
all experts on its slice and the partial outputs are all-reduced, like a dense row-parallel MLP. The
loader reads the checkpoint's per-expert tensors (`mlp.experts.E.{gate,up,down}_proj.weight`)
straight into these, each rank only its slice.

Two paths compute the router and the experts: on CUDA the fused Triton kernels (fused_moe_triton.py: tokens sorted
by expert, grouped GEMMs, no host sync, so a decode step is captured in a CUDA graph); elsewhere a
loop over the experts that received tokens, in transformers' order of operations (the CPU path,
and the reference the kernels are tested against)."""

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
    top_k] int64). Logits and softmax in fp32."""
    logits = F.linear(hidden_states.float(), router_weight.float())
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(hidden_states.dtype), ids


def experts_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, k]: a loop
    over the experts hit, as transformers' Qwen3MoeExperts (it syncs with the host)."""
    out = torch.zeros_like(x)
    for expert in torch.unique(topk_ids).tolist():
        token_idx, slot = torch.where(topk_ids == expert)
        gate, up = F.linear(x[token_idx], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * topk_weights[token_idx, slot, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


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

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor | CheckpointSlice, shard_id: tuple[int, int]
    ) -> None:
        """shard_id (expert, part): part 0 gate [I, H], 1 up [I, H], 2 down [H, I] of one expert."""
        expert, part = shard_id
        start = self.tp_rank * self.shard
        if part == 2:
            dst, src = param.data[expert], loaded.narrow(1, start, self.shard)
        else:
            dst = param.data[expert].narrow(0, part * self.shard, self.shard)
            src = loaded.narrow(0, start, self.shard)
        if dst.shape != src.shape:
            raise ValueError(
                f"expert {expert} shape mismatch: parameter {tuple(dst.shape)}, checkpoint {tuple(src.shape)}"
            )
        dst.copy_(read_tensor(src))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden]; topk_*: [num_tokens, top_k]
        if self.fused:
            from executor_service.layers import fused_moe_triton

            out = fused_moe_triton.fused_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        else:
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

            weights, ids = fused_moe_triton.route(
                hidden_states, self.gate.weight, self.top_k, self.norm_topk_prob
            )
        else:
            weights, ids = route(hidden_states, self.gate.weight, self.top_k, self.norm_topk_prob)
        return self.experts(hidden_states, weights, ids)
