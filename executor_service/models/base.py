"""What every model family shares: the pre-norm decoder stack over a flattened mixed batch
(prefill chunks and decode tokens together), the vocab-parallel embedding and LM head, and the
capabilities a family declares to the model runner and the loader:

- `attention_options`: q/k/v and o biases, per-head q/k norm;
- `fused_ops`: which Triton-fused kernels apply (the runner turns on only those layers);
- `tensor_parallel_sizes`: the sizes tensor parallelism splits, each of which it must divide;
- `checkpoint_target`: where a checkpoint tensor goes (packed q/k/v, gate/up, MoE experts);
- `check_serving`: what the family refuses to serve (a sliding window a request could cross);
- `cuda_graph_safe`: whether a decode step can be captured.

A family is one file that subclasses CausalLM and overrides what differs, plus one registry line."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from executor_service.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from executor_service.layers.mlp import DenseMLP
from executor_service.layers.norm import RMSNorm
from executor_service.layers.rotary import RotaryEmbedding
from executor_service.layers.self_attention import AttentionOptions, SelfAttention
from executor_service.model_config import ModelConfig


class DecoderLayer(nn.Module):
    def __init__(self, self_attn: nn.Module, mlp: nn.Module, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DecoderModel(nn.Module):
    def __init__(self, lm: CausalLM, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        rotary = RotaryEmbedding(config.head_dim, config.max_context_len, config.rope_parameters)
        options = lm.attention_options(config)
        self.layers = nn.ModuleList(
            [
                DecoderLayer(
                    SelfAttention(config, options, rotary, tp_rank, tp_size),
                    lm.make_mlp(config, i, tp_rank, tp_size),
                    config,
                )
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class CausalLM(nn.Module):
    """A dense decoder-only LM in Llama's layout; families override the declarations below."""

    # checkpoint name part -> (packed parameter name part, shard id for its weight_loader)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    fused_ops: ClassVar[frozenset[str]] = frozenset({"rms_norm", "silu_and_mul", "rope"})

    def __init__(
        self, config: ModelConfig, tie_word_embeddings: bool, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(self, config, tp_rank, tp_size)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        if tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # -- declarations ----------------------------------------------------------------------

    @classmethod
    def attention_options(cls, config: ModelConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias)

    def make_mlp(self, config: ModelConfig, layer_idx: int, tp_rank: int, tp_size: int) -> nn.Module:
        return DenseMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, tp_rank, tp_size)

    @classmethod
    def tensor_parallel_sizes(cls, config: ModelConfig) -> dict[str, int]:
        """Config sizes split over the ranks (the attention heads are checked on their own)."""
        return {"intermediate_size": config.intermediate_size}

    @classmethod
    def check_serving(cls, config: ModelConfig, max_model_len: int) -> None:
        """Raise ValueError, naming the setting, for what this family cannot serve."""
        if config.sliding_window is not None and max_model_len > config.sliding_window:
            raise ValueError(
                f"{config.architecture} attends through a sliding window of {config.sliding_window} "
                f"tokens, which tandem does not implement: max_model_len ({max_model_len}) must be <= "
                f"sliding_window ({config.sliding_window}), so that no request crosses it"
            )

    def checkpoint_target(self, name: str) -> tuple[str, str | int | tuple | None]:
        """(parameter name, shard id for its weight_loader or None) for a checkpoint tensor."""
        for part, (packed, shard_id) in self.packed_modules_mapping.items():
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{packed}."), shard_id
        return name, None

    def cuda_graph_safe(self) -> bool:
        return True

    def fuse_fp8_quantization(self) -> int:
        """Where an fp8 linear layer's input comes straight from a fused RMSNorm or SiLU-and-mul
        (q/k/v after the input norm, gate/up after the post-attention norm, down after the
        activation), that kernel writes its output quantized for the GEMM (the bytes fp8_linear's
        own quantization would make), one kernel and a round trip of the activation fewer each.
        Call after the fused flags and the fp8 layers are set; returns how many ops quantize."""
        from executor_service.layers.fp8_gemm_triton import GROUP

        pairs = []
        for layer in self.model.layers:
            pairs.append((layer.input_layernorm, getattr(layer.self_attn, "qkv_proj", None)))
            if isinstance(layer.mlp, DenseMLP):
                mlp = layer.mlp
                pairs += [(layer.post_attention_layernorm, mlp.gate_up_proj), (mlp.act_fn, mlp.down_proj)]
        linked = 0
        for op, linear in pairs:
            if (
                op.fused
                and linear is not None
                and linear.weight_scale_inv is not None
                and linear.block[1] == GROUP  # a weight block's columns: one activation group
            ):
                op.quantize_for = tuple(linear.weight.shape)
                linked += 1
        return linked

    # -- forward ---------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """hidden_states of the sampling tokens only: [n, hidden] -> [n, vocab_size] on rank 0,
        None on the other ranks."""
        return self.lm_head(hidden_states)
