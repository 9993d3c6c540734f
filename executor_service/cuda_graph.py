"""CUDA graphs: whole-model graphs for decode steps, piecewise graphs for every other step.

`DecodeGraphs`: one graph per batch bucket, captured largest first into one pool. A decode step of
n sequences replays the smallest bucket >= n. The rows past n are padding: slot -1 (the store
kernel skips it) and context length 0 (attention reads nothing), so they cost a little compute and
change nothing.

`MixedGraphs`: a step with a prefill chunk (alone or beside decodes) cannot be one graph, since its
attention launches depend on each sequence's query and context lengths. Eagerly, its ~350 kernel
launches cost the host ~25 ms on the W1 model whatever the chunk's length (bench/mixed_step.py),
and every running stream waits that long for its next token. As vLLM's piecewise graphs do, the
model is captured for token-count buckets as a chain of graphs that stop at each attention layer:
a replay runs graph 0 (embedding to layer 0's q/k/v), layer 0's attention eagerly on the step's
real context, graph 1 (layer 0's output projection to layer 1's q/k/v), and so on. The q/k/v of
each layer are copied into staging buffers every layer shares, and attention writes its output
into one more, so the graphs read and write fixed addresses. Rows past the step's tokens are
padding: their attention output is whatever the buffer last held (finite), and every op outside
attention is row-wise, so they change no real row."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from executor_service import context as forward_context
from executor_service.context import Context, reset_context, set_context
from executor_service.layers.attention import Attention

# The largest step MixedGraphs captures. Eagerly, a step's ~350 launches cost the host ~25 ms
# whatever its length; W2's mixed steps (a prompt of up to 1,024 tokens, sometimes two, beside a
# hundred decodes) reach ~2,300 tokens. Past 4,096 a step's GPU time rivals the launches' host time,
# so W1's 8,192-token chunks run eagerly.
MAX_MIXED_GRAPH_TOKENS = 4096

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch (and max_batch itself)."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return [*buckets, max_batch]


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, 256, 384, 512, then every multiple of 256 up to max_tokens (and
    max_tokens itself): at most ~25% padding where the step's GPU time starts to count."""
    small = [16, 32, 64, 128, 256, 384, 512]
    buckets = [b for b in small if b < max_tokens] + list(range(768, max_tokens, 256))
    return [*buckets, max_tokens]


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
        # The step's seq_order, then the padding rows in order (each program one sequence).
        self.rows = torch.arange(max_batch, dtype=torch.int32, device=device)
        self.seq_order = self.rows.clone()
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
            seq_order=self.seq_order[:n],
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
        self.pool = pool
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
        if context.seq_order is None:
            self.seq_order[:bucket] = self.rows[:bucket]
        else:
            self.seq_order[:n] = context.seq_order
            self.seq_order[n:bucket] = self.rows[n:bucket]
        self.block_tables[:n, :width] = context.block_tables
        self.graphs[bucket].replay()
        return self.hidden[:n]


@dataclass
class _Chain:
    """One bucket's graphs and, between graph i and graph i + 1, the attention layer i runs."""

    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    layers: list[nn.Module] = field(default_factory=list)


class _Recording:
    """The forward being captured (or warmed up) for MixedGraphs: Attention.forward hands each
    layer's q/k/v here instead of attending (context.recording()), and a capture ends its graph
    there."""

    def __init__(self, graphs: MixedGraphs, capture: bool) -> None:
        self.owner = graphs
        self.capture = capture
        self.chain = _Chain()
        self._graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.owner.pool)

    def end(self) -> None:
        graph, self._graph = self._graph, None
        graph.capture_end()
        self.chain.graphs.append(graph)
        if self.owner.pool is None:  # a graph's pool exists once its capture has ended
            self.owner.pool = graph.pool()

    def abort(self) -> None:
        """End a capture an exception interrupted, so that the stream can serve again."""
        if self._graph is not None:
            with contextlib.suppress(RuntimeError):  # the capture may already be invalidated
                self._graph.capture_end()
            self._graph = None

    def attention(self, layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = q.shape[0]
        owner = self.owner
        owner.q[:n].copy_(q)
        owner.k[:n].copy_(k)
        owner.v[:n].copy_(v)
        if owner.store_in_graph and layer.k_cache.numel():
            # The store joins the graph before the break (padding rows' slots are -1), so the eager
            # part between the graphs only attends.
            layer.backend.store_kv(
                owner.k[:n], owner.v[:n], layer.k_cache, layer.v_cache, owner.slot_mapping[:n],
                layer.k_scale, layer.v_scale,
            )  # fmt: skip
        self.chain.layers.append(layer)
        if self.capture:
            self.end()
            self.begin()
        return owner.out[:n]


class MixedGraphs:
    """Piecewise graphs of the model for steps that are not decode-only, one chain per token
    bucket (token_buckets), sharing the decode graphs' pool."""

    def __init__(
        self,
        model: nn.Module,
        max_tokens: int,
        hidden_size: int,
        heads: tuple[int, int, int],
        pool=None,
    ) -> None:
        """heads: (query heads, KV heads, head dim) of this rank's attention layers."""
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.model = model
        self.buckets = token_buckets(max_tokens)
        self.pool = pool
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        num_heads, kv_heads, head_dim = heads
        self.q = torch.zeros(max_tokens, num_heads, head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(max_tokens, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(max_tokens, kv_heads, head_dim, dtype=dtype, device=device)
        self.out = torch.zeros(max_tokens, num_heads, head_dim, dtype=dtype, device=device)
        self.hidden = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        # Whether each layer's K/V store is captured with the graph before its attention (backends
        # whose store is graph-safe), rather than run eagerly between the graphs.
        self.store_in_graph = all(m.backend.graph_safe for m in model.modules() if isinstance(m, Attention))
        self.chains: dict[int, _Chain] = {}
        self.num_replays = 0
        self._capture()

    def _forward(self, n: int, capture: bool) -> _Chain:
        recording = _Recording(self, capture)
        forward_context.set_recording(recording)
        try:
            if capture:
                recording.begin()
            self.hidden[:n] = self.model(self.input_ids[:n], self.positions[:n])
            if capture:
                recording.end()
        except BaseException:
            recording.abort()
            raise
        finally:
            forward_context.set_recording(None)
        return recording.chain

    @torch.inference_mode()
    def _capture(self) -> None:
        t0 = time.perf_counter()
        stream = torch.cuda.Stream()
        for n in reversed(self.buckets):
            self._forward(n, capture=False)  # warm-up: compiles and tunes outside the capture
            torch.cuda.synchronize()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.chains[n] = self._forward(n, capture=True)
            torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info(
            "captured piecewise CUDA graphs for mixed steps of %d..%d tokens (%d buckets, %d graphs) in %.1f s",
            self.buckets[0],
            self.buckets[-1],
            len(self.buckets),
            sum(len(c.graphs) for c in self.chains.values()),
            time.perf_counter() - t0,
        )

    def release(self) -> None:
        """Free every graph (DecodeGraphs.release says why)."""
        torch.cuda.synchronize()
        for chain in self.chains.values():
            for graph in chain.graphs:
                graph.reset()
        self.chains.clear()

    def can_run(self, num_tokens: int) -> bool:
        return bool(self.chains) and num_tokens <= self.buckets[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        """The forward of a step of len(input_ids) tokens; hidden states [n, hidden]."""
        n = input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= n)
        chain = self.chains[bucket]
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        if self.store_in_graph:
            self.slot_mapping[:n] = context.slot_mapping
            self.slot_mapping[n:bucket] = -1
        q, k, v, out = self.q[:n], self.k[:n], self.v[:n], self.out[:n]
        set_context(context)  # each attention layer, called between the graphs, reads it
        try:
            for graph, layer in zip(chain.graphs, chain.layers, strict=False):
                graph.replay()
                result = layer(q, k, v, kv_stored=self.store_in_graph, out=out)
                if result is not out:
                    out.copy_(result)
        finally:
            reset_context()
        chain.graphs[-1].replay()
        self.num_replays += 1
        return self.hidden[:n]
