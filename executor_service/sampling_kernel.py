"""Temperature sampling in one pass over the logits (CUDA, Triton): the common case of a serving
step, with no penalties, min-p, top-k, top-p or logprobs.

The unfused path casts the logits to fp32, divides by the temperature, takes a softmax, draws
exponential noise and divides again, with a full pass over [rows, vocab] for each: about 0.7 ms of
a 6 ms decode step at 256 rows of Qwen3's 151,936-token vocabulary on an H200. Here each row is read
once: the Gumbel-max trick, argmax(logits / T + Gumbel noise), draws from softmax(logits / T) as the
exponential race does, with the noise made in registers by Philox from a per-row seed (the Sampler
draws the seeds on the device; rows with a request seed take the unfused path)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.random import uint_to_uniform_float


# The split count and chunk follow the batch size: runtime values, not compile-time ones (a new
# variant for each would compile in the middle of serving).
@triton.jit(do_not_specialize=["chunk", "num_splits"])
def _sample_kernel(
    logits_ptr,
    temperatures_ptr,
    seeds_ptr,
    best_score_ptr,  # [rows, num_splits] fp32
    best_index_ptr,  # [rows, num_splits] int64
    stride_row,
    vocab_size,
    chunk,  # vocabulary entries per split, a multiple of BLOCK
    num_splits,
    BLOCK: tl.constexpr,
):
    # grid: (rows, num_splits). A program scans one chunk of a row's vocabulary tile by tile,
    # tracking the best perturbed score (sampling) or raw logit (greedy, temperature 0) and keeping
    # the first index on ties, as torch.argmax does. The noise of a vocabulary entry depends on
    # (seed, index) only, not on how the row is split.
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    temperature = tl.load(temperatures_ptr + row)
    greedy = temperature == 0.0
    scale = 1.4426950408889634 / tl.where(greedy, 1.0, temperature)  # log2(e) / T
    seed = tl.load(seeds_ptr + row)
    cols = tl.arange(0, BLOCK)
    quads = tl.arange(0, BLOCK // 4)
    best_score = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.full([BLOCK], 2147483647, tl.int32)
    begin = split * chunk
    end = tl.minimum(begin + chunk, vocab_size)
    for start in range(begin, end, BLOCK):
        index = start + cols
        mask = index < end
        x = tl.load(logits_ptr + row * stride_row + index, mask=mask, other=float("-inf")).to(tl.float32)
        # Four uniforms per Philox draw (the RNG, not the memory, bounded this kernel): entry i
        # takes word i % 4 of the draw at counter i // 4 (`start` is a multiple of 4).
        r0, r1, r2, r3 = tl.randint4x(seed, start // 4 + quads)
        u = uint_to_uniform_float(tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3)))
        # u in [0, 1); u = 0 gives -inf noise: never chosen
        # (x / T + Gumbel noise -ln(-ln u)) * log2(e), which has the same argmax, in base-2 logs.
        score = tl.where(greedy, x, x * scale - tl.log2(-tl.log2(u)))
        score = tl.where(mask, score, float("-inf"))
        better = score > best_score  # strictly: an earlier tile keeps a tie
        best_score = tl.where(better, score, best_score)
        best_index = tl.where(better, index, best_index)
    top = tl.max(best_score, axis=0)
    # The first index among the lanes holding the maximum (none: an empty or all -inf chunk).
    first = tl.min(tl.where(best_score == top, best_index, 2147483647), axis=0)
    tl.store(best_score_ptr + row * num_splits + split, top)
    tl.store(best_index_ptr + row * num_splits + split, first.to(tl.int64))


def num_splits_for(num_rows: int, vocab_size: int, block: int) -> int:
    """Splits of each row's vocabulary so that about 1,024 programs run (a few per SM of an H200)
    however few the rows; a power of two, and no split smaller than one tile."""
    want = max(1, min(64, -(-1024 // max(num_rows, 1)), -(-vocab_size // block)))
    return 1 << (want.bit_length() - 1)


def sample_from_logits(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    block: int = 2048,
    num_splits: int | None = None,
) -> torch.Tensor:
    """logits [n, vocab] (any float dtype, last dim contiguous), temperatures [n] fp32 (0: greedy),
    seeds [n] int64 -> token ids [n] int64. `block`: vocabulary entries per tile (a power of 2);
    `num_splits`: programs per row (default: num_splits_for)."""
    n, vocab_size = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("sample_from_logits needs row-contiguous logits")
    if not n:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    splits = num_splits or num_splits_for(n, vocab_size, block)
    chunk = -(-vocab_size // (splits * block)) * block
    scores = torch.empty(n, splits, dtype=torch.float32, device=logits.device)
    indices = torch.empty(n, splits, dtype=torch.int64, device=logits.device)
    _sample_kernel[(n, splits)](
        logits, temperatures, seeds, scores, indices, logits.stride(0), vocab_size, chunk, splits,
        BLOCK=block, num_warps=8,
    )  # fmt: skip
    if splits == 1:
        return indices.view(n).clamp_(max=vocab_size - 1)
    # The first split holding the row's best (argmax keeps the first): the lowest index on ties.
    best = scores.argmax(dim=1, keepdim=True)
    return indices.gather(1, best).view(n).clamp_(max=vocab_size - 1)
