"""CUDA graphs for decode steps: one graph per batch bucket, captured largest first into one pool.

A decode step of n sequences replays the smallest bucket >= n. The rows past n are padding:
slot -1 (the store kernel skips it) and context length 0 (attention reads nothing), so they
cost a little compute and change nothing."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from executor_service.context import Context, reset_context, set_context

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch (and max_batch itself)."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return [*buckets, max_batch]


class DecodeGraphs:
    def __init__(self, model: nn.Module, max_batch: int, max_blocks_per_seq: int, hidden_size: int) -> None:
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.model = model
        self.max_batch = max_batch
        self.buckets = batch_buckets(max_batch)
        # Static inputs and output every graph reads and writes; a replay copies the step's rows in.
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.context_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(max_batch, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture()

    def _context(self, n: int) -> Context:
        return Context(
            slot_mapping=self.slot_mapping[:n],
            block_tables=self.block_tables[:n],
            context_lens=self.context_lens[:n],
            cu_seqlens_q=self.cu_seqlens_q[: n + 1],
            cu_seqlens_k=None,
            max_seqlen_q=1,
            max_seqlen_k=self.block_tables.shape[1],
            # Host lengths route the step to the decode kernel; a graph never reads them again.
            query_lens_host=[1] * n,
            context_lens_host=[1] * n,
        )

    @torch.inference_mode()
    def _capture(self) -> None:
        t0 = time.perf_counter()
        pool = None
        for n in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            set_context(self._context(n))
            try:
                self.hidden[:n] = self.model(self.input_ids[:n], self.positions[:n])  # warm-up
                with torch.cuda.graph(graph, pool):
                    self.hidden[:n] = self.model(self.input_ids[:n], self.positions[:n])
            finally:
                reset_context()
            pool = graph.pool() if pool is None else pool
            self.graphs[n] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured %d decode CUDA graphs (batch 1..%d) in %.1f s",
            len(self.graphs),
            self.max_batch,
            time.perf_counter() - t0,
        )

    def release(self) -> None:
        """Free every captured graph. Needed before the tensor-parallel group is destroyed: NCCL's
        communicator, as it is destroyed (or aborted), waits for each graph that captured one of its
        collectives to be freed first, so leaving the group with the graphs alive hangs."""
        torch.cuda.synchronize()
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def can_run(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_batch

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        """Replay the decode forward for len(input_ids) sequences; hidden states [n, hidden]."""
        n = input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= n)
        width = context.block_tables.shape[1]
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = context.slot_mapping
        self.slot_mapping[n:bucket] = -1
        self.context_lens[:n] = context.context_lens
        self.context_lens[n:bucket] = 0
        self.block_tables[:n, :width] = context.block_tables
        self.graphs[bucket].replay()
        return self.hidden[:n]
