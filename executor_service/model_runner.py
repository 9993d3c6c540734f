"""The model runner: owns the model, the KV cache and the attention backend; turns a scheduled
batch into tensors, runs the forward and samples."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from executor_service.attention import get_backend
from executor_service.config import ExecutorConfig
from executor_service.context import Context, reset_context, set_context
from executor_service.kv_cache import KVCache, block_bytes, num_blocks_for_bytes
from executor_service.layers.attention import Attention
from executor_service.loader import checkpoint_tensor_files, load_weights
from executor_service.models import get_model_class
from executor_service.sampler import Sampler, SamplerOutput
from executor_service.sampling_metadata import SamplingMetadata, _to_device
from executor_service.sequence import SequenceState
from protos.plan import TokenLogprobs

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


@dataclass
class RunOutput:
    sampled_token_ids: list[int]  # one per sampling sequence
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prepare_seconds: float = 0.0
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0
    logits: torch.Tensor | None = None  # [num_tokens, vocab_size], only with all_logits=True


class ModelRunner:
    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        mc = config.model_config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.vocab_size = mc.vocab_size
        names = checkpoint_tensor_files(config.model)
        tied = mc.tie_word_embeddings or "lm_head.weight" not in names
        with _default_dtype(config.torch_dtype), torch.device(self.device):
            self.model = get_model_class(mc.architecture)(mc, tie_word_embeddings=tied)
        load_weights(self.model, config.model, skip=frozenset({"lm_head.weight"}) if tied else frozenset())
        self.model.eval()

        bytes_per_block = block_bytes(
            mc.num_hidden_layers, self.block_size, mc.num_key_value_heads, mc.head_dim, config.torch_dtype
        )
        num_blocks = config.num_kv_blocks or num_blocks_for_bytes(config.kv_cache_gb * 2**30, bytes_per_block)
        if num_blocks * self.block_size < config.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * self.block_size} tokens ({num_blocks} blocks of "
                f"{self.block_size}), fewer than max_model_len ({config.max_model_len}): raise "
                "num_kv_blocks or kv_cache_gb, or lower max_model_len"
            )
        self.kv_cache = KVCache(
            mc.num_hidden_layers,
            num_blocks,
            self.block_size,
            mc.num_key_value_heads,
            mc.head_dim,
            config.torch_dtype,
            self.device,
        )
        self.kv_cache.bind(self.model)
        backend = get_backend(config.attention_backend)
        for module in self.model.modules():
            if isinstance(module, Attention):
                module.backend = backend
        self.sampler = Sampler(config.seed, self.device)
        logger.info(
            "loaded %s (%s, %s) with %d KV blocks of %d tokens (%d bytes each)",
            config.model,
            mc.architecture,
            config.dtype,
            num_blocks,
            self.block_size,
            bytes_per_block,
        )

    def prepare(self, seqs: list[SequenceState], num_scheduled_tokens: list[int]) -> PreparedBatch:
        """Flatten a mixed batch (prefill chunks and decodes): sequence i computes tokens
        [c, c + n) with c = its num_computed_tokens and n = num_scheduled_tokens[i]."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        cu_q, cu_k = [0], [0]
        context_lens: list[int] = []
        block_tables: list[list[int]] = []
        logits_indices: list[int] = []
        sampling_seqs: list[SequenceState] = []
        for seq, n in zip(seqs, num_scheduled_tokens, strict=True):
            start = seq.num_computed_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            for i in range(start // bs, (end - 1) // bs + 1):
                base = seq.block_table[i] * bs - i * bs
                slot_mapping.extend(range(base + max(start, i * bs), base + min(end, (i + 1) * bs)))
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + end)
            context_lens.append(end)
            block_tables.append(seq.block_table[: (end + bs - 1) // bs])
            if end == seq.num_tokens:
                logits_indices.append(cu_q[-1] - 1)
                sampling_seqs.append(seq)
        width = max(map(len, block_tables), default=0)
        dev = self.device
        context = Context(
            slot_mapping=_to_device(slot_mapping, torch.long, dev),
            block_tables=_to_device([t + [-1] * (width - len(t)) for t in block_tables], torch.int32, dev),
            context_lens=_to_device(context_lens, torch.int32, dev),
            cu_seqlens_q=_to_device(cu_q, torch.int32, dev),
            cu_seqlens_k=_to_device(cu_k, torch.int32, dev),
            max_seqlen_q=max(num_scheduled_tokens, default=0),
            max_seqlen_k=max(context_lens, default=0),
            query_lens_host=list(num_scheduled_tokens),
            context_lens_host=context_lens,
        )
        return PreparedBatch(
            input_ids=_to_device(input_ids, torch.long, dev),
            positions=_to_device(positions, torch.long, dev),
            context=context,
            logits_indices=_to_device(logits_indices, torch.long, dev),
            sampling_seqs=sampling_seqs,
            sampling=SamplingMetadata.build(sampling_seqs, self.vocab_size, dev) if sampling_seqs else None,
        )

    @torch.inference_mode()
    def execute_model(self, batch: PreparedBatch, all_logits: bool = False) -> torch.Tensor:
        """Logits [num_sampling_seqs, vocab] (or [num_tokens, vocab] with all_logits, for tests)."""
        set_context(batch.context)
        try:
            hidden = self.model(batch.input_ids, batch.positions)
        finally:
            reset_context()
        if not all_logits:
            hidden = hidden[batch.logits_indices]
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
