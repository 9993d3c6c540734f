"""KV cache sizing: how many blocks one rank's cache holds. A fixed num_kv_blocks, a kv_cache_gb
budget off CUDA, or on CUDA what gpu_memory_utilization leaves after a warm-up forward at the
largest batch; with tensor parallelism the smallest count over the ranks."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from executor_service import parallel
from executor_service.config import check_kv_blocks_hold
from executor_service.kv_cache import KVCache
from executor_service.layers.attention import Attention
from executor_service.sampling_metadata import SamplingMetadata
from executor_service.sequence import SequenceState
from protos.plan import StepSamplingParams

if TYPE_CHECKING:
    from executor_service.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def determine_num_kv_blocks(runner: ModelRunner, bytes_per_block: int) -> int:
    """The KV block count every rank holds; ValueError when it cannot hold max_model_len tokens."""
    config = runner.config
    if config.num_kv_blocks:
        num_blocks = config.num_kv_blocks
    elif runner.device.type == "cuda":
        num_blocks = num_blocks_from_free_memory(runner, bytes_per_block)
    else:
        num_blocks = config.kv_cache_gb_blocks()
    if runner.tp_size > 1:  # the scheduler sees one block count: every rank must hold it
        num_blocks = parallel.min_over_ranks(num_blocks, runner.device)
    knob = "gpu_memory_utilization" if runner.device.type == "cuda" else "kv_cache_gb"
    check_kv_blocks_hold(num_blocks, runner.block_size, config.max_model_len, f"num_kv_blocks or {knob}")
    return num_blocks


def num_blocks_from_free_memory(runner: ModelRunner, bytes_per_block: int) -> int:
    """blocks = (total x gpu_memory_utilization - used - (peak - current)) / block bytes, with
    `peak` measured over a warm-up forward and sampling at the largest batch."""
    config = runner.config
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    warm_up(runner)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info(runner.device)
    used = total - free
    peak = torch.cuda.max_memory_allocated(runner.device)
    current = torch.cuda.memory_allocated(runner.device)
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
def warm_up(runner: ModelRunner) -> None:
    """A prefill of max_num_batched_tokens tokens, then sampling for max_num_seqs rows, through a
    temporary KV cache just large enough (its bytes are counted in the peak: conservative)."""
    config, mc = runner.config, runner.config.model_config
    seq_len = min(config.max_model_len, config.max_num_batched_tokens)
    num_seqs = max(1, min(config.max_num_batched_tokens // seq_len, config.max_num_seqs))
    blocks_per_seq = -(-seq_len // runner.block_size)
    cache = KVCache(
        mc.num_hidden_layers,
        num_seqs * blocks_per_seq,
        runner.block_size,
        runner.num_kv_heads,
        mc.head_dim,
        config.kv_torch_dtype,
        runner.device,
    )
    cache.bind(runner.model)
    seqs = [
        SequenceState(i, [0] * seq_len, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), 0,
                      StepSamplingParams(), seq_len)
        for i in range(num_seqs)
    ]  # fmt: skip
    for seq in seqs:
        runner.add_sequence(seq)
    try:
        runner.execute_model(runner.prepare(seqs, [seq_len] * num_seqs))
    finally:
        for seq in seqs:
            runner.remove_sequence(seq)
        for module in runner.model.modules():
            if isinstance(module, Attention):
                module.k_cache = module.v_cache = torch.tensor([])
    if not runner.is_driver:
        return
    logits = torch.zeros(config.max_num_seqs, mc.vocab_size, dtype=config.torch_dtype, device=runner.device)
    params = [StepSamplingParams(temperature=1.0, top_k=50, top_p=0.9)] * config.max_num_seqs
    states = [SequenceState(i, [0], [], 0, p, 1) for i, p in enumerate(params)]
    runner.sampler(logits, SamplingMetadata.build(states, mc.vocab_size, runner.device))
    del cache, logits
