"""Token embedding and LM head, laid out for vocab parallelism (tp_size 1 for now)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.shard_size = -(-vocab_size // tp_size)
        self.vocab_start = tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = loaded.narrow(0, self.vocab_start, min(self.shard_size, self.vocab_size - self.vocab_start))
        if shard.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}"
            )
        param.data[: shard.shape[0]].copy_(shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight)
        return out * in_shard.unsqueeze(-1)  # the all-reduce over ranks would follow


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [num_sampling_tokens, hidden] -> logits [num_sampling_tokens, vocab_size]."""
        logits = F.linear(hidden_states, self.weight)
        return logits[:, : self.vocab_size] if self.tp_size == 1 else logits  # gather would follow
