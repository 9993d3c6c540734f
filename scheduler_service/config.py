"""Scheduler configuration and the effective limits it resolves against the executor."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from protos.defaults import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS
from protos.plan import ExecutorInfo

logger = logging.getLogger(__name__)

# Backpressure is on by default (--max-queue, --max-queued-tokens; 0 = no limit).
# Requests that may wait beyond the free batch slots. TGI refuses past 128 concurrent requests
# (max_concurrent_requests, "overloaded"); this counts only the waiting ones, on top of a batch of
# up to 256 (max_num_seqs): four full batches of queue.
DEFAULT_MAX_QUEUE = 1024
# Prompt tokens of admitted requests without output yet: 2**20 is 128 full 8192-token steps of
# prefill (many seconds of work before the newest request sees a token) and a few tens of MiB of
# token ids in the scheduler, far from what threatens its memory.
DEFAULT_MAX_QUEUED_TOKENS = 1 << 20
# vLLM's default. Each top logprob of each token is kept and sent: at 4096 (a whole vocabulary)
# a 1,000-token request took 0.5 GB of scheduler memory.
DEFAULT_MAX_LOGPROBS = 20


@dataclass
class SchedulerConfig:
    max_num_seqs: int = MAX_NUM_SEQS
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS
    enable_prefix_caching: bool = True
    # None = the executor's max_model_len.
    max_model_len: int | None = None
    # Plans sent before the oldest result is read: 2 hides the scheduler and the network behind
    # the executor's step (engine.py and scheduler.py tell how); 3 (a remote executor) also keeps
    # the next plan waiting at the executor while it runs two, so that the scheduler's round trip
    # is off its path; None = 2 for an executor that takes a plan ahead (send/receive: the gRPC one
    # and LocalExecutor), else 1.
    max_plans_in_flight: int | None = None
    # The most top logprobs per token a request may ask for.
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    # While any sequence decodes, a step's prefill tokens (chunks of prompts, recomputes) stay within
    # this budget, so that a long prompt arriving does not stretch the decodes' inter-token latency
    # (vLLM's long_prefill_token_threshold, SGLang's chunked prefill size). 0: no budget beyond
    # max_num_batched_tokens. Off by default until measured on the GPU (W1 and W2).
    max_prefill_tokens_while_decoding: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.max_prefill_tokens_while_decoding < 0:
            raise ValueError(
                "max_prefill_tokens_while_decoding must be >= 0 (0 for no budget), "
                f"got {self.max_prefill_tokens_while_decoding}"
            )
        if self.max_plans_in_flight not in (None, 1, 2, 3):
            raise ValueError(f"max_plans_in_flight must be 1, 2 or 3, got {self.max_plans_in_flight}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(
                f"max_model_len must be >= 2 (or None for the executor's), got {self.max_model_len}"
            )


@dataclass(frozen=True)
class SchedulerLimits:
    """The minimum of the config and what the executor reported in `describe()`."""

    block_size: int
    num_kv_blocks: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    enable_prefix_caching: bool
    max_logprobs: int = DEFAULT_MAX_LOGPROBS


def resolve_limits(config: SchedulerConfig, info: ExecutorInfo) -> SchedulerLimits:
    if info.block_size < 1 or info.num_kv_blocks < 1:
        raise ValueError(
            f"executor reported block_size={info.block_size}, num_kv_blocks={info.num_kv_blocks}; "
            "both must be >= 1"
        )
    max_model_len = info.max_model_len
    if config.max_model_len is not None:
        if config.max_model_len > info.max_model_len:
            logger.warning(
                "max_model_len %d is above the executor's %d; using %d",
                config.max_model_len,
                info.max_model_len,
                info.max_model_len,
            )
        max_model_len = min(config.max_model_len, info.max_model_len)
    capacity = info.num_kv_blocks * info.block_size
    if capacity < max_model_len:
        # One sequence must always fit in the whole cache, or preemption could loop forever.
        logger.warning(
            "the KV cache holds %d tokens (%d blocks of %d), less than max_model_len %d; "
            "max_model_len is lowered to %d",
            capacity,
            info.num_kv_blocks,
            info.block_size,
            max_model_len,
            capacity,
        )
        max_model_len = capacity
    return SchedulerLimits(
        block_size=info.block_size,
        num_kv_blocks=info.num_kv_blocks,
        max_model_len=max_model_len,
        max_num_seqs=_min_positive(config.max_num_seqs, info.max_num_seqs),
        max_num_batched_tokens=_min_positive(config.max_num_batched_tokens, info.max_num_batched_tokens),
        vocab_size=info.vocab_size,
        eos_token_ids=tuple(info.eos_token_ids),
        enable_prefix_caching=config.enable_prefix_caching,
        max_logprobs=config.max_logprobs,
    )


def _min_positive(ours: int, theirs: int) -> int:
    # An executor reporting 0 sets no limit of its own.
    return min(ours, theirs) if theirs > 0 else ours


@dataclass
class EngineOptions:
    config: SchedulerConfig
    # Named in UNAVAILABLE messages.
    executor_address: str = "in-process"
    # Requests beyond the free batch slots that may wait (None or 0: no limit).
    max_queue: int | None = DEFAULT_MAX_QUEUE
    # Prompt tokens of admitted requests that have not produced a token yet (None or 0: no limit).
    max_queued_tokens: int | None = DEFAULT_MAX_QUEUED_TOKENS
    # Idle probe of the executor, and reconnect backoff (seconds).
    heartbeat_s: float = 2.0
    backoff_min_s: float = 0.1
    backoff_max_s: float = 2.0
    # How long accepted requests wait for a lost executor before failing UNAVAILABLE (None: forever).
    recovery_timeout_s: float | None = 300.0

    def __post_init__(self) -> None:
        for name in ("max_queue", "max_queued_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 (0 or None for no limit), got {value}")
            if value == 0:
                setattr(self, name, None)
