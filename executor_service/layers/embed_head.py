"""Token embedding and LM head split over the vocabulary: rank r holds rows
[r * shard_size, (r + 1) * shard_size), the last shard padded with zero rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor_service.loader import CheckpointSlice
from executor_service.parallel import all_reduce, gather_to_rank0


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

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | CheckpointSlice) -> None:
        if loaded.shape[1:] != param.shape[1:] or loaded.shape[0] != self.vocab_size:
            raise ValueError(
                f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}"
            )
        shard = loaded.narrow(0, self.vocab_start, min(self.shard_size, self.vocab_size - self.vocab_start))
        param.data[: shard.shape[0]].copy_(shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight)
        return all_reduce(out * in_shard.unsqueeze(-1))


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """hidden_states: [num_sampling_tokens, hidden] -> logits [num_sampling_tokens, vocab_size]
        on rank 0 (the shards gathered there for sampling), None on the other ranks."""
        logits = F.linear(hidden_states, self.weight)
        if self.tp_size > 1:
            logits = gather_to_rank0(logits, self.tp_rank, self.tp_size)
        return logits[:, : self.vocab_size] if logits is not None else None
