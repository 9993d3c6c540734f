"""Qwen3-MoE: Qwen3's attention, and in every `decoder_sparse_step`-th layer not listed in
`mlp_only_layers` a sparse MoE block (layers/moe.py) instead of the dense MLP."""

from __future__ import annotations

import re
from typing import ClassVar

from torch import nn

from executor_service.layers.moe import EXPERT_PROJECTIONS, FusedMoE, SparseMoeBlock
from executor_service.model_config import ModelConfig
from executor_service.models.qwen3 import Qwen3ForCausalLM

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$")


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    fused_ops: ClassVar[frozenset[str]] = Qwen3ForCausalLM.fused_ops | {"fused_moe"}

    def make_mlp(self, config: ModelConfig, layer_idx: int, tp_rank: int, tp_size: int) -> nn.Module:
        if not config.is_moe_layer(layer_idx):
            return super().make_mlp(config, layer_idx, tp_rank, tp_size)
        return SparseMoeBlock(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            config.norm_topk_prob,
            tp_rank,
            tp_size,
        )

    @classmethod
    def tensor_parallel_sizes(cls, config: ModelConfig) -> dict[str, int]:
        sizes = {"moe_intermediate_size": config.moe_intermediate_size}
        if not all(config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
            sizes["intermediate_size"] = config.intermediate_size
        return sizes

    def checkpoint_target(self, name: str) -> tuple[str, str | int | tuple | None]:
        expert = _EXPERT.match(name)
        if expert is None:
            return super().checkpoint_target(name)
        prefix, index, projection, scale = expert.groups()
        packed = "w2_weight" if projection == "down_proj" else "w13_weight"
        return f"{prefix}.{packed}{scale or ''}", (int(index), EXPERT_PROJECTIONS[projection])

    def cuda_graph_safe(self) -> bool:
        # The reference expert loop syncs with the host; the fused kernels do not.
        return all(m.fused for m in self.modules() if isinstance(m, FusedMoE))
