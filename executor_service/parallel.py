"""Tensor parallelism: the process group, the collectives the layers use and the plan broadcast.

Rank 0 is the executor (the process serving gRPC, or an in-process LocalExecutor); it spawns
ranks 1..N-1 (tp_worker.py). All ranks join one torch.distributed group (NCCL on CUDA, gloo
on CPU) for the model's collectives, and a second gloo group on the CPU for the messages rank 0
broadcasts every step: the plan, pickled. Every rank applies the plan to its own copy of the
per-sequence state and prepares the same batch, so a step ships a few KB, not tensors."""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from protos.plan import StepPlan

logger = logging.getLogger(__name__)

# The collectives of a step: a rank that waits this long for its peers gives up.
STEP_TIMEOUT = timedelta(minutes=10)
# Ranks 1..N-1 wait for the next plan for as long as the executor idles.
IDLE_TIMEOUT = timedelta(days=365)


@dataclass(slots=True)
class TPMessage:
    """What rank 0 sends the other ranks: one per step, reset or shutdown."""

    kind: str  # "step", "reset" or "close"
    plan: StepPlan | None = None
    all_logits: bool = False
    # The tokens rank 0 sampled in the previous step, one per sampling sequence, in batch order:
    # the other ranks append them to their state (one message per step instead of two).
    sampled_token_ids: list[int] = field(default_factory=list)


# -- head layout -------------------------------------------------------------------------------


def num_kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads split across ranks; with more ranks than KV heads each rank holds one (replicated)."""
    return max(1, num_kv_heads // tp_size)


def kv_head_shard(tp_rank: int, num_kv_heads: int, tp_size: int) -> int:
    """Which slice of num_kv_heads_per_rank heads rank `tp_rank` holds: the one its query heads use."""
    if tp_size <= num_kv_heads:
        return tp_rank
    return tp_rank * num_kv_heads // tp_size


def check_tp_layout(num_heads: int, num_kv_heads: int, intermediate_size: int, tp_size: int) -> None:
    if num_heads % tp_size:
        raise ValueError(f"tensor_parallel_size ({tp_size}) must divide num_attention_heads ({num_heads})")
    if intermediate_size % tp_size:
        raise ValueError(
            f"tensor_parallel_size ({tp_size}) must divide intermediate_size ({intermediate_size})"
        )
    if (num_kv_heads % tp_size) if tp_size <= num_kv_heads else (tp_size % num_kv_heads):
        raise ValueError(
            f"tensor_parallel_size ({tp_size}) and num_key_value_heads ({num_kv_heads}) must divide "
            "one another"
        )


# -- process group -----------------------------------------------------------------------------


def rank_device(device: str, tp_rank: int) -> str:
    """Rank r runs on the r-th GPU after the one asked for (cuda -> cuda:r, cuda:2 -> cuda:2+r)."""
    if not device.startswith("cuda"):
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + tp_rank}"


def init_group(
    device: str, master_addr: str, master_port: int, tp_rank: int, tp_size: int
) -> dist.ProcessGroup:
    """Join the tensor-parallel group; returns the gloo group that carries the plan broadcast."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=tp_rank,
        world_size=tp_size,
        timeout=STEP_TIMEOUT,
    )
    plan_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    logger.info(
        "rank %d of %d joined the %s group at %s:%d", tp_rank, tp_size, backend, master_addr, master_port
    )
    return plan_group


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast_message(message: TPMessage, group: dist.ProcessGroup) -> None:
    """Rank 0: the message, pickled, as a length then the bytes (two gloo broadcasts)."""
    payload = torch.frombuffer(
        bytearray(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8
    )
    dist.broadcast(torch.tensor([payload.numel()], dtype=torch.int64), src=0, group=group)
    dist.broadcast(payload, src=0, group=group)


def receive_message(group: dist.ProcessGroup) -> TPMessage:
    """Ranks 1..N-1: block until rank 0 broadcasts the next message."""
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=0, group=group)
    return pickle.loads(payload.numpy().tobytes())


# -- collectives the model uses ----------------------------------------------------------------


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def gather_to_rank0(x: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor | None:
    """[n, shard] on every rank -> [n, tp_size * shard] on rank 0, None elsewhere."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp_size)] if tp_rank == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if parts is not None else None


def min_over_ranks(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
