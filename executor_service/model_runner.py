"""The model runner: owns the model, the KV cache and the attention backend; runs a scheduled
batch (flattened into tensors by batch.py) through the forward and samples. runner_startup.py
builds one: the model, then the KV cache sized by kv_cache_sizing.py, then the kernel warm-up."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from executor_service import parallel
from executor_service.attention import get_backend
from executor_service.batch import PreparedBatch, prepare_batch
from executor_service.block_tables import BlockTables
from executor_service.config import ExecutorConfig
from executor_service.context import reset_context, set_context
from executor_service.cuda_graph import MAX_MIXED_GRAPH_TOKENS, DecodeGraphs, MixedGraphs
from executor_service.device_timeline import DeviceTimeline
from executor_service.kv_cache import KVCache
from executor_service.layers.attention import Attention
from executor_service.layers.fp8_layers import convert_to_fp8
from executor_service.layers.fusable import Fusable
from executor_service.loader import checkpoint_tensor_files, head_is_tied, load_weights
from executor_service.prompt_logprobs import (
    PromptLogprobsOutput,
    compute_prompt_logprobs,
    prompt_logprobs_results,
)
from executor_service.quantization import scale_names
from executor_service.sampler import Sampler, SamplerOutput
from executor_service.sampling_metadata import SamplingMetadata
from executor_service.sequence import SequenceState
from protos.plan import PromptLogprobs, TokenLogprobs

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
class Launch:
    """A step whose forward and sampling are queued on the device: `ModelRunner.collect` waits
    for it. On CUDA the sampled ids are copied to pinned host memory behind the sampler, and
    `done` records the copy, so that waiting for this step does not wait for one queued after."""

    batch: PreparedBatch
    logits: torch.Tensor | None
    sampled: SamplerOutput | None
    host_token_ids: torch.Tensor | None = None
    # Logprobs copied to the host behind the sampler, when a row asked for them (CUDA).
    host_logprobs: SamplerOutput | None = None
    # Prompt logprobs scored this step (rank 0), on the host on CUDA.
    prompt_logprobs: PromptLogprobsOutput | None = None
    done: torch.cuda.Event | None = None
    prepare_seconds: float = 0.0
    forward_seconds: float = 0.0

    def ready(self) -> bool:
        return self.done is None or self.done.query()


@dataclass
class RunOutput:
    sampled_token_ids: list[int]  # one per sampling sequence
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prepare_seconds: float = 0.0
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0
    logits: torch.Tensor | None = None  # [num_tokens, vocab_size], only with all_logits=True
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)


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
        tied = head_is_tied(names, mc.tie_word_embeddings)
        with _default_dtype(config.torch_dtype), torch.device(self.device):
            self.model = config.model_class(
                mc, tie_word_embeddings=tied, tp_rank=tp_rank, tp_size=self.tp_size
            )
        # An fp8 checkpoint's linear layers stay e4m3 on CUDA (the W8A8 GEMM), and so do the MoE
        # experts where the fused kernels run them; elsewhere the loader dequantizes them to the
        # compute dtype.
        fp8_weights = frozenset()
        if mc.quantization is not None and self.device.type == "cuda":
            fused_moe = self._fused("fused_moe")
            scales = scale_names(names, mc.quantization)
            fp8_weights = convert_to_fp8(self.model, scales, mc.quantization.block, experts=fused_moe)
        load_weights(
            self.model,
            config.model,
            skip=frozenset({"lm_head.weight"}) if tied else frozenset(),
            quantization=mc.quantization,
            keeps_fp8=fp8_weights.__contains__,
        )
        self.model.eval()

        self.bytes_per_block = config.kv_block_bytes()
        backend = get_backend(config.attention_backend)
        for module in self.model.modules():
            if isinstance(module, Attention):
                module.backend = backend
            if isinstance(module, Fusable):  # on where the model declares the layer's fused op
                module.fused = self._fused(module.fused_op)
        if fp8_weights:
            self.model.fuse_fp8_quantization()
        self.sampler = Sampler(
            config.seed, self.device, fused=config.fused_ops == "on" and self.device.type == "cuda"
        )
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        self.block_tables = BlockTables(self.max_blocks_per_seq, initial_rows=config.max_num_seqs)
        self.num_graph_steps = 0
        # The device's time in steps and between them (rank 0 on CUDA; device_timeline.py).
        self.timeline = DeviceTimeline() if self.device.type == "cuda" and self.is_driver else None
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        # Sequences held that ask for prompt logprobs, and for a logit bias or min_tokens: prepare()
        # looks for the rows that need them only while some do.
        self._num_scoring_prompts = 0
        self._num_biasing = 0
        # The last batch's sampling metadata, reused by the next batch whose rows have the same
        # parameters (SamplingMetadata.build).
        self._last_sampling: SamplingMetadata | None = None
        self._graph_safe = backend.graph_safe and self.model.cuda_graph_safe()
        self.kv_cache: KVCache | None = None  # bind_kv_cache() sets it

    def _fused(self, fused_op: str) -> bool:
        """Whether the layers of `fused_op` take their fused kernels."""
        return self.config.fused_ops == "on" and fused_op in self.model.fused_ops

    def bind_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache (its size: kv_cache_sizing.py) and the CUDA graphs (decode graphs
        that read it, piecewise graphs for the other steps); runner_startup.py calls it once the
        model is loaded."""
        config, mc = self.config, self.config.model_config
        self.kv_cache = KVCache(
            mc.num_hidden_layers,
            num_blocks,
            self.block_size,
            self.num_kv_heads,
            mc.head_dim,
            config.kv_torch_dtype,
            self.device,
        )
        self.kv_cache.bind(self.model)
        logger.info(
            "rank %d/%d: loaded %s (%s, %s, %s attention, fused ops %s) with %d KV blocks of %d "
            "tokens (%s, %.2f GiB)",
            self.tp_rank,
            self.tp_size,
            config.model,
            mc.architecture,
            config.dtype,
            config.attention_backend,
            config.fused_ops,
            num_blocks,
            self.block_size,
            config.kv_cache_dtype,
            num_blocks * self.bytes_per_block / 2**30,
        )
        if self.device.type == "cuda" and not config.enforce_eager and self._graph_safe:
            self.graphs = DecodeGraphs(
                self.model, config.max_num_seqs, self.max_blocks_per_seq, mc.hidden_size
            )
        if self.device.type == "cuda" and not config.enforce_eager and self.model.cuda_graph_safe():
            # Attention runs eagerly between the pieces, so any backend serves them.
            max_tokens = min(config.max_num_batched_tokens, MAX_MIXED_GRAPH_TOKENS)
            pool = self.graphs.pool if self.graphs is not None else None
            heads = (mc.num_attention_heads // self.tp_size, self.num_kv_heads, mc.head_dim)
            self.mixed_graphs = MixedGraphs(self.model, max_tokens, mc.hidden_size, heads, pool)

    def release_cuda_graphs(self) -> None:
        """Before leaving the tensor-parallel group (DecodeGraphs.release says why); later steps run
        eagerly."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        if self.mixed_graphs is not None:
            self.mixed_graphs.release()
            self.mixed_graphs = None

    # -- sequences --------------------------------------------------------------------------

    def add_sequence(self, seq: SequenceState) -> None:
        seq.row = self.block_tables.add(seq.block_table)
        self._count(seq, 1)

    def remove_sequence(self, seq: SequenceState) -> None:
        self.block_tables.free(seq.row)
        seq.row = -1
        self._count(seq, -1)

    def _count(self, seq: SequenceState, added: int) -> None:
        params = seq.sampling_params
        if params.prompt_logprobs is not None:
            self._num_scoring_prompts += added
        if params.logit_bias_token_ids or params.min_tokens:
            self._num_biasing += added

    def append_blocks(self, seq: SequenceState, block_ids: list[int]) -> None:
        seq.block_table.extend(block_ids)
        self.block_tables.extend(seq.row, block_ids)

    def prepare(
        self,
        seqs: list[SequenceState],
        num_scheduled_tokens: list[int],
        pending: torch.Tensor | None = None,
    ) -> PreparedBatch:
        """Flatten a mixed batch (prefill chunks and decodes): sequence i computes tokens
        [c, c + n) with c = its num_computed_tokens and n = num_scheduled_tokens[i]; placeholder
        input tokens come from `pending`, the ids sampled by the step in flight."""
        batch = prepare_batch(
            seqs,
            num_scheduled_tokens,
            self.block_tables,
            self.block_size,
            self.vocab_size,
            self.device,
            self.is_driver,
            pending,
            score_prompts=self._num_scoring_prompts > 0,
            bias_logits=self._num_biasing > 0,
            previous_sampling=self._last_sampling,
        )
        if batch.sampling is not None:
            self._last_sampling = batch.sampling
        return batch

    @torch.inference_mode()
    def execute_model(
        self, batch: PreparedBatch, all_logits: bool = False
    ) -> tuple[torch.Tensor | None, PromptLogprobsOutput | None]:
        """Logits [num_sampling_seqs, vocab] (or [num_tokens, vocab] with all_logits, for tests),
        None on ranks other than 0 and with tensor parallelism when no row samples; and the
        prompt logprobs the batch scores (rank 0)."""
        if batch.decode_only and self.graphs is not None and self.graphs.can_run(len(batch.input_ids)):
            hidden = self.graphs.run(batch.input_ids, batch.positions, batch.context)
            self.num_graph_steps += 1
        elif self.mixed_graphs is not None and self.mixed_graphs.can_run(len(batch.input_ids)):
            hidden = self.mixed_graphs.run(batch.input_ids, batch.positions, batch.context)
            self.num_graph_steps += 1
        else:
            set_context(batch.context)
            try:
                hidden = self.model(batch.input_ids, batch.positions)
            finally:
                reset_context()
        prompt = None
        if batch.prompt_logprobs is not None:
            prompt = compute_prompt_logprobs(self.model, hidden, batch.prompt_logprobs)
        if not all_logits:
            hidden = hidden[batch.logits_indices]
        if self.tp_size > 1 and hidden.shape[0] == 0:
            return None, prompt  # nothing to gather: every rank knows it from the plan
        return self.model.compute_logits(hidden), prompt

    @torch.inference_mode()
    def launch(
        self,
        seqs: list[SequenceState],
        num_scheduled_tokens: list[int],
        pending: torch.Tensor | None = None,
        all_logits: bool = False,
    ) -> Launch:
        """Prepare, forward and sample without waiting for the device (see Launch)."""
        t0 = time.perf_counter()
        batch = self.prepare(seqs, num_scheduled_tokens, pending)
        # After the inputs' copies, before the forward: a device idle meanwhile waited on the host.
        timeline = self.timeline if self.timeline is not None and not self.timeline.stopped else None
        started = timeline.begin() if timeline is not None else None
        t1 = time.perf_counter()
        logits, prompt = self.execute_model(batch, all_logits)
        sampled = None
        if batch.sampling is not None:
            sampled = self.sampler(logits[batch.logits_indices] if all_logits else logits, batch.sampling)
        # Logits are kept only when asked for: with two steps in flight, each would hold [n, vocab].
        launch = Launch(batch, logits if all_logits else None, sampled, prepare_seconds=t1 - t0)
        launch.prompt_logprobs = prompt
        on_cuda = self.device.type == "cuda"
        if sampled is not None and on_cuda:
            launch.host_token_ids = _to_host(sampled.sampled_token_ids)
            if sampled.sampled_logprobs is not None:
                launch.host_logprobs = SamplerOutput(
                    launch.host_token_ids,
                    _to_host(sampled.sampled_logprobs),
                    _to_host(sampled.top_token_ids),
                    _to_host(sampled.top_logprobs),
                )
        if prompt is not None and on_cuda:
            launch.prompt_logprobs = PromptLogprobsOutput(
                *(
                    _to_host(t)
                    for t in (prompt.token_logprobs, prompt.ranks, prompt.top_logprobs, prompt.top_token_ids)
                )
            )
        if on_cuda and (sampled is not None or prompt is not None):
            launch.done = DeviceTimeline.event()
            launch.done.record()
        if started is not None:
            timeline.end(started, launch.done)
        if self.tp_size > 1 and batch.sampling_seqs:
            # Rank 0's sampled ids to every rank's device (after the host copy, which need not wait
            # for it): a step launched before this one is collected takes its inputs from them.
            if sampled is None:  # ranks other than 0 keep only these ids
                ids = torch.empty(len(batch.sampling_seqs), dtype=torch.int64, device=self.device)
                launch.sampled = SamplerOutput(ids)
            parallel.broadcast_from_rank0(launch.sampled.sampled_token_ids)
        # On CUDA this measures launch time; collect() waits for the device work.
        launch.forward_seconds = time.perf_counter() - t1
        return launch

    def collect(self, launch: Launch, all_logits: bool = False) -> RunOutput:
        """Wait for a launched step; its sampled ids (and logprobs) on the host."""
        t0 = time.perf_counter()
        out = RunOutput(sampled_token_ids=[], logits=launch.logits if all_logits else None)
        if launch.done is not None:
            launch.done.synchronize()
        if self.timeline is not None:
            self.timeline.settle()
        if launch.prompt_logprobs is not None:
            out.prompt_logprobs = prompt_logprobs_results(
                launch.batch.prompt_logprobs, launch.prompt_logprobs
            )
        if launch.sampled is not None:
            if launch.done is not None:
                out.sampled_token_ids = launch.host_token_ids.tolist()
            else:
                out.sampled_token_ids = launch.sampled.sampled_token_ids.tolist()
            if launch.sampled.sampled_logprobs is not None:
                out.logprobs = _logprobs(launch.batch, launch.host_logprobs or launch.sampled)
        out.prepare_seconds, out.forward_seconds = launch.prepare_seconds, launch.forward_seconds
        out.sample_seconds = time.perf_counter() - t0
        return out


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy, made behind the work queued so far (read it after an event)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def _logprobs(batch: PreparedBatch, sampled: SamplerOutput) -> list[TokenLogprobs]:
    sampled_lp = sampled.sampled_logprobs.tolist()
    top_ids = sampled.top_token_ids.tolist()
    top_lp = sampled.top_logprobs.tolist()
    result = []
    for row, (seq, n) in enumerate(zip(batch.sampling_seqs, batch.sampling.num_logprobs, strict=True)):
        if n > 0:
            result.append(TokenLogprobs(seq.seq_id, [sampled_lp[row]], top_ids[row][:n], top_lp[row][:n]))
    return result
