"""Start-up compilation of the kernel variants serving steps can reach.

Triton compiles a kernel the first time it runs with a new set of compile-time constants. CUDA-graph
capture covers the decode-only steps, but a mixed step (decode rows beside a prefill chunk), a prefill
chunk after a cached prefix, and each split count of the decode kernel are variants of their own: on
a fresh machine each would compile, for a second or more, in the middle of serving. One small eager
step of each at start moves that cost to start-up (and into Triton's on-disk cache for the next).
The steps run through the bound KV cache, so with kv_cache_dtype fp8 they compile the KV_FP8 variants."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from executor_service.layers.attention import Attention
from executor_service.layers.moe import FusedMoE
from executor_service.sequence import SequenceState
from protos.plan import StepSamplingParams

if TYPE_CHECKING:
    from executor_service.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def warm_up_steps(block_size: int, batch_sizes: list[int], decode_only: bool) -> list[list[tuple[int, int]]]:
    """Steps as lists of (sequence length, tokens already computed): a chunk continuing after a
    cached prefix alone, then at each batch size n a mixed step (n - 1 decode rows and one such
    chunk), and with `decode_only` (no CUDA graphs to compile those) a decode step of n rows."""
    chunk = (2 * block_size + 7, block_size)
    decode = (block_size + 5, block_size + 4)
    steps = [[chunk]]
    for n in batch_sizes:
        if n >= 2:
            steps.append([decode] * (n - 1) + [chunk])
        if decode_only:
            steps.append([decode] * n)
    return steps


@torch.inference_mode()
def warm_up_kernels(runner: ModelRunner, num_blocks: int) -> int:
    """Runs the warm-up steps through the bound KV cache (its blocks are free until the scheduler
    connects, and a block is always written before it is read); returns how many steps ran. Every
    tensor-parallel rank runs the same steps, so their collectives pair up."""
    backend = next(m.backend for m in runner.model.modules() if isinstance(m, Attention))
    sizes = backend.variant_batch_sizes(
        runner.config.max_num_seqs, runner.num_kv_heads, runner.device, runner.config.kv_torch_dtype
    )
    steps = warm_up_steps(runner.block_size, sizes, decode_only=runner.graphs is None)
    t0, ran = time.perf_counter(), 0
    for step in steps:
        blocks_per_seq = [-(-length // runner.block_size) for length, _ in step]
        # A step no serving step could look like (longer than max_model_len, more blocks than the
        # cache) is left out.
        if sum(blocks_per_seq) > num_blocks or max(n for n, _ in step) > runner.config.max_model_len:
            continue
        seqs, next_block = [], 0
        for i, ((length, computed), nb) in enumerate(zip(step, blocks_per_seq, strict=True)):
            table = list(range(next_block, next_block + nb))
            next_block += nb
            seqs.append(SequenceState(i, [0] * length, table, computed, StepSamplingParams(), length))
        try:
            for seq in seqs:
                runner.add_sequence(seq)
            runner.execute_model(
                runner.prepare(seqs, [len(s.token_ids) - s.num_computed_tokens for s in seqs])
            )
        finally:
            for seq in seqs:
                if seq.row >= 0:
                    runner.remove_sequence(seq)
        ran += 1
    moe = next((m for m in runner.model.modules() if isinstance(m, FusedMoE) and m.fused), None)
    if moe is not None:  # every tile configuration of the fused experts (one layer's: all are alike)
        from executor_service.layers.fused_moe_triton import warm_up as warm_up_moe

        warm_up_moe(
            moe.w13_weight, moe.w2_weight, moe.top_k, runner.config.max_num_batched_tokens,
            runner.config.torch_dtype, moe.w13_weight_scale_inv, moe.w2_weight_scale_inv,
        )  # fmt: skip
    if runner.sampler.fused:  # the one-pass sampler, on logits of the model's dtype
        from executor_service.sampling_kernel import sample_from_logits

        logits = torch.zeros(2, runner.vocab_size, dtype=runner.config.torch_dtype, device=runner.device)
        seeds = torch.zeros(2, dtype=torch.int64, device=runner.device)
        sample_from_logits(logits, torch.tensor([0.0, 1.0], device=runner.device), seeds)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    logger.info(
        "rank %d: warmed up %d kernel variants in %.1f s", runner.tp_rank, ran, time.perf_counter() - t0
    )
    return ran
