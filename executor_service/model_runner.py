"""The model runner: owns the model, the KV cache and the attention backend; turns a scheduled
batch into tensors, runs the forward and samples."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from executor_service import parallel
from executor_service.attention import get_backend
from executor_service.block_tables import BlockTables
from executor_service.config import ExecutorConfig
from executor_service.context import Context, reset_context, set_context
from executor_service.cuda_graph import DecodeGraphs
from executor_service.kv_cache import KVCache, block_bytes, num_blocks_for_bytes
from executor_service.layers.attention import Attention
from executor_service.loader import checkpoint_tensor_files, load_weights
from executor_service.models import get_model_class
from executor_service.sampler import Sampler, SamplerOutput
from executor_service.sampling_metadata import SamplingMetadata
from executor_service.sequence import SequenceState
from protos.plan import StepSamplingParams, TokenLogprobs

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    context: Context
    logits_indices: torch.Tensor  # [num_sampling_seqs], rows of the flattened batch that sample
    sampling_seqs: list[SequenceState]  # the sequences that sample, in batch order
    sampling: SamplingMetadata | None
    decode_only: bool = False


@dataclass
class RunOutput:
    sampled_token_ids: list[int]  # one per sampling sequence
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prepare_seconds: float = 0.0
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0
    logits: torch.Tensor | None = None  # [num_tokens, vocab_size], only with all_logits=True


class ModelRunner:
    """One tensor-parallel rank's model and KV cache (the only one with tensor_parallel_size 1).
    Only rank 0 (the driver) builds sampling metadata and samples."""

    def __init__(self, config: ExecutorConfig, tp_rank: int = 0) -> None:
        self.config = config
        mc = config.model_config
        self.tp_rank, self.tp_size = tp_rank, config.tensor_parallel_size
        self.is_driver = tp_rank == 0
        self.device = torch.device(parallel.rank_device(config.device, tp_rank))
        self.block_size = config.block_size
        self.vocab_size = mc.vocab_size
        self.num_kv_heads = parallel.num_kv_heads_per_rank(mc.num_key_value_heads, self.tp_size)
        if self.tp_size > mc.num_key_value_heads and self.is_driver:
            logger.warning(
                "tensor parallel size %d exceeds the model's %d KV heads: each rank holds the KV "
                "head its query heads use, each KV head replicated on %d ranks",
                self.tp_size,
                mc.num_key_value_heads,
                self.tp_size // mc.num_key_value_heads,
            )
        names = checkpoint_tensor_files(config.model)
        tied = mc.tie_word_embeddings or "lm_head.weight" not in names
        with _default_dtype(config.torch_dtype), torch.device(self.device):
            self.model = get_model_class(mc.architecture)(
                mc, tie_word_embeddings=tied, tp_rank=tp_rank, tp_size=self.tp_size
            )
        load_weights(self.model, config.model, skip=frozenset({"lm_head.weight"}) if tied else frozenset())
        self.model.eval()

        bytes_per_block = block_bytes(
            mc.num_hidden_layers, self.block_size, self.num_kv_heads, mc.head_dim, config.torch_dtype
        )
        backend = get_backend(config.attention_backend)
        for module in self.model.modules():
            if isinstance(module, Attention):
                module.backend = backend
            if hasattr(module, "fused"):  # the layers with a Triton-fused path
                module.fused = config.fused_ops == "on"
        self.sampler = Sampler(config.seed, self.device)
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        self.block_tables = BlockTables(self.max_blocks_per_seq, initial_rows=config.max_num_seqs)
        self.num_graph_steps = self.num_eager_steps = 0
        self.graphs: DecodeGraphs | None = None
        if config.num_kv_blocks:
            num_blocks = config.num_kv_blocks
        elif self.device.type == "cuda":
            num_blocks = self._num_blocks_from_free_memory(bytes_per_block)
        else:
            num_blocks = num_blocks_for_bytes(config.kv_cache_gb * 2**30, bytes_per_block)
        if self.tp_size > 1:  # the scheduler sees one block count: every rank must hold it
            num_blocks = parallel.min_over_ranks(num_blocks, self.device)
        if num_blocks * self.block_size < config.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * self.block_size} tokens ({num_blocks} blocks of "
                f"{self.block_size}), fewer than max_model_len ({config.max_model_len}): raise "
                "num_kv_blocks, kv_cache_gb or gpu_memory_utilization, or lower max_model_len"
            )
        self.kv_cache = KVCache(
            mc.num_hidden_layers,
            num_blocks,
            self.block_size,
            self.num_kv_heads,
            mc.head_dim,
            config.torch_dtype,
            self.device,
        )
        self.kv_cache.bind(self.model)
        logger.info(
            "rank %d/%d: loaded %s (%s, %s, %s attention, fused ops %s) with %d KV blocks of %d "
            "tokens (%.2f GiB)",
            tp_rank,
            self.tp_size,
            config.model,
            mc.architecture,
            config.dtype,
            config.attention_backend,
            config.fused_ops,
            num_blocks,
            self.block_size,
            num_blocks * bytes_per_block / 2**30,
        )
        if self.device.type == "cuda" and not config.enforce_eager and backend.graph_safe:
            self.graphs = DecodeGraphs(
                self.model, config.max_num_seqs, self.max_blocks_per_seq, mc.hidden_size
            )

    def _num_blocks_from_free_memory(self, bytes_per_block: int) -> int:
        """blocks = (total x gpu_memory_utilization - used - (peak - current)) / block bytes, with
        `peak` measured over a warm-up forward and sampling at the largest batch."""
        config = self.config
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self._warm_up()
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        peak = torch.cuda.max_memory_allocated(self.device)
        current = torch.cuda.memory_allocated(self.device)
        budget = total * config.gpu_memory_utilization - used - (peak - current)
        num_blocks = int(budget // bytes_per_block)
        logger.info(
            "GPU memory: total %.1f GiB, used %.1f GiB, warm-up peak %.1f GiB over %.1f GiB current: "
            "%d KV blocks at gpu_memory_utilization %.2f",
            total / 2**30,
            used / 2**30,
            peak / 2**30,
            current / 2**30,
            num_blocks,
            config.gpu_memory_utilization,
        )
        if num_blocks <= 0:
            raise ValueError(
                f"no GPU memory left for the KV cache at gpu_memory_utilization "
                f"{config.gpu_memory_utilization}: raise it or lower max_num_batched_tokens"
            )
        return num_blocks

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """A prefill of max_num_batched_tokens tokens, then sampling for max_num_seqs rows, through a
        temporary KV cache just large enough (its bytes are counted in the peak: conservative)."""
        config, mc = self.config, self.config.model_config
        seq_len = min(config.max_model_len, config.max_num_batched_tokens)
        num_seqs = max(1, min(config.max_num_batched_tokens // seq_len, config.max_num_seqs))
        blocks_per_seq = -(-seq_len // self.block_size)
        cache = KVCache(
            mc.num_hidden_layers,
            num_seqs * blocks_per_seq,
            self.block_size,
            self.num_kv_heads,
            mc.head_dim,
            config.torch_dtype,
            self.device,
        )
        cache.bind(self.model)
        seqs = [
            SequenceState(i, [0] * seq_len, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), 0,
                          StepSamplingParams(), seq_len)
            for i in range(num_seqs)
        ]  # fmt: skip
        for seq in seqs:
            self.add_sequence(seq)
        try:
            self.execute_model(self.prepare(seqs, [seq_len] * num_seqs))
        finally:
            for seq in seqs:
                self.remove_sequence(seq)
            for module in self.model.modules():
                if isinstance(module, Attention):
                    module.k_cache = module.v_cache = torch.tensor([])
        if not self.is_driver:
            return
        logits = torch.zeros(config.max_num_seqs, mc.vocab_size, dtype=config.torch_dtype, device=self.device)
        params = [StepSamplingParams(temperature=1.0, top_k=50, top_p=0.9)] * config.max_num_seqs
        states = [SequenceState(i, [0], [], 0, p, 1) for i, p in enumerate(params)]
        self.sampler(logits, SamplingMetadata.build(states, mc.vocab_size, self.device))
        del cache, logits

    # -- sequences --------------------------------------------------------------------------

    def add_sequence(self, seq: SequenceState) -> None:
        seq.row = self.block_tables.add(seq.block_table)

    def remove_sequence(self, seq: SequenceState) -> None:
        self.block_tables.free(seq.row)
        seq.row = -1

    def append_blocks(self, seq: SequenceState, block_ids: list[int]) -> None:
        seq.block_table.extend(block_ids)
        self.block_tables.extend(seq.row, block_ids)

    def prepare(self, seqs: list[SequenceState], num_scheduled_tokens: list[int]) -> PreparedBatch:
        """Flatten a mixed batch (prefill chunks and decodes): sequence i computes tokens
        [c, c + n) with c = its num_computed_tokens and n = num_scheduled_tokens[i]."""
        bs = self.block_size
        num_seqs = len(seqs)
        q_lens = np.asarray(num_scheduled_tokens, dtype=np.int64)
        starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, num_seqs)
        ends = starts + q_lens
        num_tokens = int(q_lens.sum())
        if num_tokens == num_seqs:  # decode only: one token per sequence
            positions = starts
            input_ids = np.fromiter((s.token_ids[s.num_computed_tokens] for s in seqs), np.int64, num_seqs)
            token_seq = np.arange(num_seqs)
        else:
            positions = np.concatenate([np.arange(a, b) for a, b in zip(starts.tolist(), ends.tolist())])
            input_ids = np.fromiter(
                itertools.chain.from_iterable(
                    s.token_ids[s.num_computed_tokens : s.num_computed_tokens + n]
                    for s, n in zip(seqs, num_scheduled_tokens)
                ),
                np.int64,
                num_tokens,
            )
            token_seq = np.repeat(np.arange(num_seqs), q_lens)
        rows = np.fromiter((s.row for s in seqs), np.int64, num_seqs)
        width = int(-(-ends.max() // bs))
        tables = self.block_tables.gather(rows, width)  # [num_seqs, width] int32
        slot_mapping = tables[token_seq, positions // bs].astype(np.int64) * bs + positions % bs
        cu_q = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu_q[1:])
        cu_k = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(ends, out=cu_k[1:])
        samples = ends == np.fromiter((len(s.token_ids) for s in seqs), np.int64, num_seqs)
        logits_indices = cu_q[1:][samples] - 1
        sampling_seqs = [s for s, m in zip(seqs, samples.tolist()) if m]

        # Two host-to-device copies per step: the int64 columns and the int32 ones.
        longs = self._to_device(np.concatenate([input_ids, positions, slot_mapping, logits_indices]))
        ints = self._to_device(np.concatenate([ends, cu_q, cu_k, tables.ravel()]).astype(np.int32))
        input_ids_d, positions_d, slot_mapping_d, logits_indices_d = longs.split(
            [num_tokens, num_tokens, num_tokens, len(logits_indices)]
        )
        context_lens_d, cu_q_d, cu_k_d, tables_d = ints.split(
            [num_seqs, num_seqs + 1, num_seqs + 1, num_seqs * width]
        )
        context_lens_host = ends.tolist()
        context = Context(
            slot_mapping=slot_mapping_d,
            block_tables=tables_d.view(num_seqs, width),
            context_lens=context_lens_d,
            cu_seqlens_q=cu_q_d,
            cu_seqlens_k=cu_k_d,
            max_seqlen_q=int(q_lens.max()),
            max_seqlen_k=max(context_lens_host),
            query_lens_host=list(num_scheduled_tokens),
            context_lens_host=context_lens_host,
        )
        return PreparedBatch(
            input_ids=input_ids_d,
            positions=positions_d,
            context=context,
            logits_indices=logits_indices_d,
            sampling_seqs=sampling_seqs,
            sampling=SamplingMetadata.build(sampling_seqs, self.vocab_size, self.device)
            if sampling_seqs and self.is_driver
            else None,
            decode_only=num_tokens == num_seqs,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute_model(self, batch: PreparedBatch, all_logits: bool = False) -> torch.Tensor | None:
        """Logits [num_sampling_seqs, vocab] (or [num_tokens, vocab] with all_logits, for tests);
        None on ranks other than 0, and with tensor parallelism when no row samples."""
        if batch.decode_only and self.graphs is not None and self.graphs.can_run(len(batch.input_ids)):
            hidden = self.graphs.run(batch.input_ids, batch.positions, batch.context)
            self.num_graph_steps += 1
        else:
            set_context(batch.context)
            try:
                hidden = self.model(batch.input_ids, batch.positions)
            finally:
                reset_context()
            self.num_eager_steps += 1
        if not all_logits:
            hidden = hidden[batch.logits_indices]
        if self.tp_size > 1 and hidden.shape[0] == 0:
            return None  # nothing to gather: every rank knows it from the plan
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def run(
        self, seqs: list[SequenceState], num_scheduled_tokens: list[int], all_logits: bool = False
    ) -> tuple[PreparedBatch, RunOutput]:
        t0 = time.perf_counter()
        batch = self.prepare(seqs, num_scheduled_tokens)
        t1 = time.perf_counter()
        logits = self.execute_model(batch, all_logits)
        # On CUDA this measures launch time; the device work is waited for by the copy below.
        t2 = time.perf_counter()
        out = RunOutput(sampled_token_ids=[], logits=logits if all_logits else None)
        if batch.sampling is not None:
            sample_logits = logits[batch.logits_indices] if all_logits else logits
            sampled = self.sampler(sample_logits, batch.sampling)
            out.sampled_token_ids = sampled.sampled_token_ids.tolist()
            if sampled.sampled_logprobs is not None:
                out.logprobs = _logprobs(batch, sampled)
        t3 = time.perf_counter()
        out.prepare_seconds, out.forward_seconds, out.sample_seconds = t1 - t0, t2 - t1, t3 - t2
        return batch, out


def _logprobs(batch: PreparedBatch, sampled: SamplerOutput) -> list[TokenLogprobs]:
    sampled_lp = sampled.sampled_logprobs.tolist()
    top_ids = sampled.top_token_ids.tolist()
    top_lp = sampled.top_logprobs.tolist()
    result = []
    for row, (seq, n) in enumerate(zip(batch.sampling_seqs, batch.sampling.num_logprobs, strict=True)):
        if n > 0:
            result.append(TokenLogprobs(seq.seq_id, [sampled_lp[row]], top_ids[row][:n], top_lp[row][:n]))
    return result
