"""Tensor parallelism: the process group, the collectives the layers use and the plan broadcast.

Rank 0 is the executor (the process serving gRPC, or an in-process LocalExecutor); it starts
ranks 1..N-1 (tp_worker.py). All ranks join one torch.distributed group (NCCL on CUDA, gloo
on CPU) for the model's collectives. The message rank 0 sends every step (the plan, pickled)
goes down a pipe to each rank, the rank's stdin: 45-70 us per step against 0.6-0.65 ms for two
broadcasts on a gloo group (bench/tp_broadcast.py, 256-sequence decode plan, TP=2, 2 CPU
cores); no timeout while the executor idles, and a rank reads EOF the moment rank 0 dies. Every rank
applies the plan to its own copy of the per-sequence state and prepares the same batch, so a
step ships a few KB, not tensors."""

from __future__ import annotations

import logging
import pickle
import struct
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import BinaryIO

import torch
import torch.distributed as dist

from protos.plan import StepPlan

logger = logging.getLogger(__name__)

# The collectives of a step: a rank that waits this long for its peers gives up.
STEP_TIMEOUT = timedelta(minutes=10)
_HEADER = struct.Struct("<Q")  # message length in bytes


@dataclass(slots=True)
class TPMessage:
    """What rank 0 sends the other ranks: one per step, reset or shutdown."""

    kind: str  # "step", "reset" or "close"
    plan: StepPlan | None = None
    all_logits: bool = False
    # The tokens rank 0 sampled in the launched steps it collected since its last message, one
    # list per step in order, one token per sampling sequence in batch order: the other ranks put
    # them in place of their placeholders (one message per step instead of two).
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # Whether this step's inputs include tokens of the step launched before it that are not on the
    # host yet: each rank takes them from that step's ids broadcast on the device.
    pending: bool = False
    # time.monotonic_ns() when rank 0 sent it (one clock for every process of the host): the
    # receiving rank measures the broadcast's latency, pickling and pipe included.
    sent_ns: int = 0


# -- head layout -------------------------------------------------------------------------------


def num_kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads split across ranks; with more ranks than KV heads each rank holds one (replicated)."""
    return max(1, num_kv_heads // tp_size)


def kv_head_shard(tp_rank: int, num_kv_heads: int, tp_size: int) -> int:
    """Which slice of num_kv_heads_per_rank heads rank `tp_rank` holds: the one its query heads use."""
    if tp_size <= num_kv_heads:
        return tp_rank
    return tp_rank * num_kv_heads // tp_size


def check_tp_layout(num_heads: int, num_kv_heads: int, sharded_sizes: dict[str, int], tp_size: int) -> None:
    """`sharded_sizes`: the other config sizes the model splits over ranks (its declaration)."""
    if num_heads % tp_size:
        raise ValueError(f"tensor_parallel_size ({tp_size}) must divide num_attention_heads ({num_heads})")
    for name, size in sharded_sizes.items():
        if size % tp_size:
            raise ValueError(f"tensor_parallel_size ({tp_size}) must divide {name} ({size})")
    if (num_kv_heads % tp_size) if tp_size <= num_kv_heads else (tp_size % num_kv_heads):
        raise ValueError(
            f"tensor_parallel_size ({tp_size}) and num_key_value_heads ({num_kv_heads}) must divide "
            "one another"
        )


# -- process group -----------------------------------------------------------------------------


def rank_device(device: str, tp_rank: int) -> str:
    """Rank r runs on the r-th GPU after the one asked for (cuda -> cuda:r, cuda:2 -> cuda:2+r)."""
    if not device.startswith("cuda") or tp_rank == 0:
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + tp_rank}"


def init_group(device: str, master_addr: str, master_port: int, tp_rank: int, tp_size: int) -> None:
    """Join the tensor-parallel group (this process's default torch.distributed group)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(device.partition(":")[2] or 0))
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=tp_rank,
        world_size=tp_size,
        timeout=STEP_TIMEOUT,
    )
    logger.info(
        "rank %d of %d joined the %s group at %s:%d", tp_rank, tp_size, backend, master_addr, master_port
    )


def destroy_group(timeout: float = 60.0) -> bool:
    """Leave the group; a rank that cannot (a peer gone mid-collective) logs it and goes on after
    `timeout` seconds rather than hanging its process's shutdown. False then: the process should
    end with os._exit (a normal exit could wait for the communicator again)."""
    if not dist.is_initialized():
        return True
    done = threading.Thread(target=dist.destroy_process_group, name="destroy-process-group", daemon=True)
    done.start()
    done.join(timeout)
    if done.is_alive():
        logger.error(
            "leaving the tensor-parallel group did not finish in %.0f s: going on without it", timeout
        )
        return False
    return True


def encode_message(message: TPMessage) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


def read_message(stream: BinaryIO) -> TPMessage:
    """Block until rank 0 sends the next message; EOFError when rank 0 is gone."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("rank 0 closed the plan pipe")
    (size,) = _HEADER.unpack(header)
    payload = stream.read(size)
    if len(payload) < size:
        raise EOFError("rank 0 closed the plan pipe mid-message")
    return pickle.loads(payload)


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


def broadcast_from_rank0(x: torch.Tensor) -> None:
    """Rank 0's tensor into `x` on every other rank (in place, queued on the current stream)."""
    dist.broadcast(x, src=0)


def min_over_ranks(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
