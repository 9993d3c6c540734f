"""The Triton backend: our paged-KV kernels, plus PyTorch's FlashAttention-2 for prefill without prefix.

Routing per step (decided once in `prepare`, from the host lengths):
- every query length 1 (decode, CUDA-graph padded or not): the paged decode kernel over all rows,
  split-KV when batch x KV heads is small next to the SM count;
- no sequence has a cached prefix (query length == context length for all) and `varlen_attn` is
  available with native GQA (or the model has as many KV heads as query heads): `varlen_attn` on
  this step's contiguous q/k/v, causal. torch 2.11's `varlen_attn` has no `enable_gqa`; repeating
  K/V for it made a 64 x 512 Qwen3 prefill 0.74 ms on the H200 against 0.31 ms for our paged
  prefill kernel (varlen_attn alone, KV pre-repeated: 0.47 ms), so GQA prefill goes to Triton there;
- otherwise (prefix-cache hits, later prefill chunks, mixed batches): the decode kernel takes the
  rows of query length 1 and the paged prefill kernel the others; each launch skips the other's rows.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from executor_service.attention.base import AttentionBackend
from executor_service.context import Context

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10
    varlen_attn = None

try:
    from executor_service.attention import triton_kernels as kernels
except ImportError:  # no triton (CPU-only installs)
    kernels = None

_VARLEN_PARAMS = frozenset(inspect.signature(varlen_attn).parameters) if varlen_attn else frozenset()


@dataclass
class StepPlan:
    context: Context
    num_seqs: int
    decode_only: bool  # every query length is 1
    has_decode: bool
    no_prefix: bool  # query length == context length for every sequence


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def prefill_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: Context, scale: float, repeat_kv: bool = False
):
    """Causal attention of this step's tokens among themselves (no cached prefix), via varlen_attn.
    Returns None where varlen_attn cannot serve: missing, dtype, a torch without `scale`, or GQA on
    a torch without `enable_gqa` unless repeat_kv (repeat the KV heads first: slower than Triton)."""
    if varlen_attn is None or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    if k.shape[1] != q.shape[1] and "enable_gqa" not in _VARLEN_PARAMS and not repeat_kv:
        return None
    kwargs = {}
    if "scale" in _VARLEN_PARAMS:
        kwargs["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-6:
        return None
    if "window_size" in _VARLEN_PARAMS:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in _VARLEN_PARAMS:
            kwargs["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    cu = context.cu_seqlens_q
    return varlen_attn(q, k, v, cu, cu, context.max_seqlen_q, context.max_seqlen_q, **kwargs)


class TritonPagedBackend(AttentionBackend):
    name = "triton"
    graph_safe = True
    fp8_kv = True
    fused_store = True

    def __init__(self) -> None:
        self._plan: StepPlan | None = None

    @staticmethod
    def supports(device: torch.device) -> bool:
        return device.type == "cuda" and kernels is not None

    def prepare(self, context: Context) -> StepPlan:
        q_lens, ctx_lens = context.query_lens_host, context.context_lens_host
        self._plan = StepPlan(
            context=context,
            num_seqs=len(q_lens),
            decode_only=all(n == 1 for n in q_lens),
            has_decode=any(n == 1 for n in q_lens),
            no_prefix=all(n == c for n, c in zip(q_lens, ctx_lens, strict=True)),
        )
        return self._plan

    def variant_batch_sizes(
        self, max_num_seqs: int, num_kv_heads: int, device: torch.device, kv_dtype: torch.dtype | None = None
    ) -> list[int]:
        # The split count is a compile-time constant of the decode and reduce kernels.
        config = kernels.decode_config(kv_dtype)
        first: dict[int, int] = {}
        for n in range(1, max_num_seqs + 1):
            first.setdefault(kernels.choose_num_splits(n, num_kv_heads, _num_sms(device), config), n)
        return sorted({*first.values(), min(2, max_num_seqs)})

    def decode_stores_kv(self, k_cache: torch.Tensor, context: Context) -> bool:
        return self.prepared(context).decode_only and kernels.decode_stores_kv(k_cache)

    def decode_fuses_rope(self, k_cache: torch.Tensor, context: Context) -> bool:
        return self.prepared(context).decode_only and kernels.decode_fuses_rope(k_cache, k_cache.shape[-1])

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
        kernels.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        context: Context,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        kv_stored: bool = False,
        out: torch.Tensor | None = None,
        rope=None,
    ) -> torch.Tensor:
        """AttentionBackend.forward; rope: a DecodeRope where decode_fuses_rope said so (q and k
        not yet normalised and rotated)."""
        plan = self.prepared(context)
        if rope is not None and (kv_stored or not self.decode_fuses_rope(k_cache, context)):
            raise ValueError("rope: only a decode step whose kernel stores K/V normalises and rotates them")
        new_kv = None  # this step's K/V for the decode kernel to store (decode_stores_kv)
        if k_cache.numel() and not kv_stored:
            if self.decode_stores_kv(k_cache, context):
                new_kv = (k, v, context.slot_mapping)
            else:
                kernels.store_kv(k, v, k_cache, v_cache, context.slot_mapping, k_scale, v_scale)
        if plan.no_prefix and not plan.decode_only:
            varlen = prefill_varlen(q, k, v, context, scale)
            if varlen is not None:
                return varlen
        if not k_cache.numel():  # a profiling forward before the cache exists: no prefix by construction
            varlen = prefill_varlen(q, k, v, context, scale, repeat_kv=True) if plan.no_prefix else None
            if varlen is None:
                raise ValueError(
                    "the triton backend needs the KV cache bound unless varlen_attn serves the step"
                )
            return varlen
        out = torch.empty_like(q) if out is None else out
        meta = (context.block_tables, context.context_lens, context.cu_seqlens_q)
        if plan.has_decode:
            num_kv_heads = k_cache.shape[2]
            splits = kernels.choose_num_splits(
                plan.num_seqs, num_kv_heads, _num_sms(q.device), kernels.decode_config(k_cache.dtype)
            )
            rows = 0 if plan.decode_only else 1
            kernels.paged_decode(
                q,
                k_cache,
                v_cache,
                out,
                *meta,
                scale,
                num_splits=splits,
                rows=rows,
                kv_scales=(k_scale, v_scale),
                seq_order=context.seq_order,
                new_kv=new_kv,
                rope=rope,
            )
        if not plan.decode_only:
            rows = 2 if plan.has_decode else 0
            kernels.paged_prefill(
                q,
                k_cache,
                v_cache,
                out,
                *meta,
                context.max_seqlen_q,
                scale,
                rows=rows,
                kv_scales=(k_scale, v_scale),
            )
        return out
