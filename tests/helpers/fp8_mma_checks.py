"""The e4m3-MMA decode (the decode config's FP8_MMA) against a torch model of its arithmetic.

Shared by tests/test_triton_interpret.py (the interpreter) and tests/test_triton_kernels.py (the
GPU). The model follows the kernel step by step in fp32: the query split into two e4m3 parts
(split_e4m3), the key tiles and splits, the online softmax in the scores' own units, the
probabilities (x 256) as two e4m3 parts for P @ V, and the split reduce. It sums in other orders
than the kernel's MMAs and (on the GPU) takes exact exp2 where the kernel takes MUFU.EX2, so a few
probabilities' parts round to a neighbouring e4m3 value (which the other part then mostly makes up):
the outputs agree within the output dtype's rounding."""

from __future__ import annotations

import contextlib
import math

import torch

from executor_service.context import Context
from helpers.attention_checks import NAN, longest_first

LOG2E = 1.4426950408889634
E4M3 = torch.float8_e4m3fn


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 (to nearest even), back in fp32; |x| must be within e4m3's range."""
    assert x.abs().max() <= 448, "a value the kernel would saturate"
    return x.to(E4M3).float()


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c rounded once, as an fp32 FMA (the fp64 product of two fp32 values is exact)."""
    return (a.double() * b.double() + c.double()).float()


def split_query(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """split_e4m3 in torch: rows of x (fp32) -> (16 x hi, lo, scale), x ~ (16 hi + lo) * scale."""
    amax = x.abs().amax(1, keepdim=True).clamp(min=1e-30)
    inv = 28.0 / amax
    hi = _e4m3(x * inv)
    lo = _e4m3((x - hi * (amax / 28.0)) * (16.0 * inv))
    return _e4m3(hi * 16.0), lo, (amax / 448.0)[:, 0]


def _split_partial(k, v, hi16, lo, row_scale, tiles: range, block_n: int, context_len: int, v_scale: float):
    """One split's (o [rows, head_dim], log-sum-exp [rows]) over key tiles `tiles` of k, v [keys, head_dim]."""
    rows = hi16.shape[0]
    m = torch.full((rows,), -math.inf)
    total = torch.zeros(rows)  # the probabilities' sum
    acc = torch.zeros(rows, k.shape[1])
    for tile in tiles:
        keys = slice(tile * block_n, min((tile + 1) * block_n, context_len))
        d = k[keys] @ lo.T + k[keys] @ hi16.T  # [keys, rows]: the scores in units of row_scale
        m_new = torch.maximum(m, d.amax(0))
        m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
        p = torch.exp2(_fma(d, row_scale[None, :], (8.0 - m_safe * row_scale)[None, :]))
        alpha = torch.exp2((m - m_safe) * row_scale)
        total = total * alpha + p.sum(0)
        p_hi = _e4m3(p)
        acc = acc * alpha[:, None] + (p_hi + _e4m3((p - p_hi) * 16.0) / 16.0).T @ v[keys]
        m = m_new
    o = acc / torch.where(total > 0, total, 1.0)[:, None] * v_scale
    lse = torch.where(total > 0, (m * row_scale - 8.0) + torch.log2(total), -math.inf)
    return o, lse


def fp8_mma_reference(batch: dict, num_splits: int, block_n: int) -> torch.Tensor:
    """What the FP8_MMA decode kernel computes for the batch's real (decode) rows: [rows, heads, head_dim] fp32."""
    from executor_service.fp8 import v_cache_slots

    ctx, (k_scale, v_scale) = batch["context"], batch["kv_scales"]
    q = batch["q"].cpu()  # (on the CPU: the model is fp32 arithmetic, wherever the kernel ran)
    num_heads, head_dim = q.shape[1], q.shape[2]
    k_cache, v_slots = batch["k_cache"].cpu(), v_cache_slots(batch["v_cache"]).cpu()
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    qk_scale = torch.tensor(
        batch["scale"] * LOG2E * k_scale, dtype=torch.float32
    )  # the kernel's fp32 argument
    num_real = len(ctx.query_lens_host) - batch["num_padding"]
    out = torch.zeros(num_real, num_heads, head_dim)
    for i in range(num_real):
        assert ctx.query_lens_host[i] == 1, "decode rows only"
        context_len = ctx.context_lens_host[i]
        blocks = ctx.block_tables[i, : -(-context_len // block_size)].long().cpu()
        k_seq = k_cache[blocks].flatten(0, 1)[:context_len].float()  # e4m3 values: k_scale is in qk_scale
        v_seq = v_slots[blocks].flatten(0, 1)[:context_len].float()
        num_tiles = -(-context_len // block_n)
        per_split = -(-num_tiles // num_splits)
        for kv_head in range(num_kv_heads):
            heads = slice(kv_head * group, (kv_head + 1) * group)
            hi16, lo, q_scale = split_query(q[i, heads].float())
            row_scale = q_scale * qk_scale
            parts = []
            for split in range(num_splits):
                tiles = range(split * per_split, min((split + 1) * per_split, num_tiles))
                k_head, v_head = k_seq[:, kv_head], v_seq[:, kv_head]
                parts.append(
                    _split_partial(k_head, v_head, hi16, lo, row_scale, tiles, block_n, context_len, v_scale)
                )
            if num_splits == 1:
                out[i, heads] = parts[0][0]
                continue
            lse = torch.stack(
                [p[1] for p in parts]
            )  # [splits, rows], as split_kv_reduce_kernel combines them
            top = lse.amax(0)
            w = torch.exp2(lse - torch.where(top == -math.inf, 0.0, top))
            o = sum(w[s][:, None] * parts[s][0] for s in range(num_splits))
            total = w.sum(0)
            out[i, heads] = o / torch.where(total > 0, total, 1.0)[:, None]
    return out


class _LaunchSpy:
    """Stands in for a Triton kernel: records each launch's keyword arguments, then launches it."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


@contextlib.contextmanager
def decode_kernel_launches():
    """The keyword arguments of each launch of paged_attention_kernel while the block runs (its
    constexprs: which loop, which loads, which tile)."""
    from executor_service.attention import triton_kernels as tk

    spy = _LaunchSpy(tk.paged_attention_kernel)
    tk.paged_attention_kernel = spy
    try:
        yield spy.launches
    finally:
        tk.paged_attention_kernel = spy.kernel


def _decode(batch: dict, num_splits: int, config: dict) -> tuple[torch.Tensor, list[dict]]:
    """paged_decode of the batch (its caches stored already) under config, longest first: (the output,
    NaN where unwritten; the kernel's launches)."""
    from executor_service.attention import triton_kernels as tk

    ctx, q = batch["context"], batch["q"]
    out = torch.full_like(q, NAN)
    with decode_kernel_launches() as launches:
        tk.paged_decode(
            q, batch["k_cache"], batch["v_cache"], out, ctx.block_tables, ctx.context_lens, ctx.cu_seqlens_q,
            batch["scale"], num_splits, config=config, kv_scales=batch["kv_scales"],
            seq_order=longest_first(ctx.context_lens),
        )  # fmt: skip
    return out, launches


def check_decode_fp8_mma(batch: dict, num_splits: int = 1, decode_config: dict | None = None) -> None:
    """A decode step (the store, then decode) over e4m3 caches with FP8_MMA: the kernel launched with
    it, its output within the output dtype's rounding of fp8_mma_reference, and within 2% (relative
    norm) of exact attention over the same cache (torch_ref), which the e4m3 query and
    probabilities' parts separate it from."""
    from executor_service.attention import torch_ref
    from executor_service.attention import triton_kernels as tk

    config = {**tk.DECODE_CONFIG_FP8, "FP8_MMA": True, **(decode_config or {})}
    ctx, kv_scales, q = batch["context"], batch["kv_scales"], batch["q"]
    tk.store_kv(batch["k"], batch["v"], batch["k_cache"], batch["v_cache"], ctx.slot_mapping, *kv_scales)
    out, launches = _decode(batch, num_splits, config)
    assert [launch.get("FP8_MMA") for launch in launches] == [True], "the decode kernel did not take FP8_MMA"
    num_real = len(ctx.query_lens_host) - batch["num_padding"]
    got = out[:num_real].float()
    assert not got.isnan().any(), "unwritten or NaN output rows"
    assert (out[num_real:] == 0).all(), "padding rows (context length 0) must be zeros"
    want = fp8_mma_reference(batch, num_splits, config["BLOCK_N"]).to(got.device)
    # Within the output dtype's rounding under the interpreter (fp32 sums in one order; it truncates
    # a bf16 store, up to one unit in the last place); on sm90 the e4m3 MMAs accumulate with fewer
    # bits (Triton's default for e4m3 dots) and exp2 is MUFU.EX2's, so a few probabilities' parts
    # round the other way: a looser bound there, and on the norm.
    on_gpu = got.is_cuda
    tol = 2e-2 if q.dtype == torch.bfloat16 else (1e-2 if on_gpu else 1e-3)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    rel_model = (got - want).norm() / want.norm()
    bound = 1e-2 if q.dtype == torch.bfloat16 else (5e-3 if on_gpu else 1e-3)
    assert rel_model < bound, f"relative error against the model {rel_model:.3g}"
    real = Context(
        block_tables=ctx.block_tables[:num_real],
        query_lens_host=ctx.query_lens_host[:num_real],
        context_lens_host=ctx.context_lens_host[:num_real],
    )
    exact = torch_ref.paged_attention(
        q[:num_real].float(), batch["k_cache"], batch["v_cache"], real, batch["scale"], *kv_scales
    )
    rel = (got - exact).norm() / exact.norm()
    assert rel < 2e-2, f"relative error against exact attention {rel:.3g}"


def check_tma_kv(batch: dict, num_splits: int = 1, decode_config: dict | None = None) -> None:
    """The fp8 decode kernel (FP8_MMA unless decode_config turns it off) with its K and V^T tiles
    through TMA descriptors (TMA_KV) against the same kernel's pointer loads: the launch took TMA_KV,
    and the outputs are the same bits (the same bytes reach the same MMAs; only who computes their
    addresses differs). A box at the wrong block, slot or head would read other keys."""
    from executor_service.attention import triton_kernels as tk

    ctx, kv_scales = batch["context"], batch["kv_scales"]
    tk.store_kv(batch["k"], batch["v"], batch["k_cache"], batch["v_cache"], ctx.slot_mapping, *kv_scales)
    outs = []
    for tma in (False, True):
        config = {**tk.DECODE_CONFIG_FP8, "FP8_MMA": True, **(decode_config or {}), "TMA_KV": tma}
        out, launches = _decode(batch, num_splits, config)
        taken = [(launch.get("FP8_MMA", False), launch.get("TMA_KV", False)) for launch in launches]
        assert taken == [(config["FP8_MMA"], tma)], launches
        outs.append(out)
    num_real = len(ctx.query_lens_host) - batch["num_padding"]
    assert not outs[1][:num_real].isnan().any(), "unwritten or NaN output rows"
    assert torch.equal(outs[1], outs[0]), (outs[1] - outs[0]).abs().max()
