"""The step plan and step result as plain data, and their conversion to and from protobuf.

In-process (LocalExecutor) the scheduler and the executor exchange these dataclasses
directly; over gRPC (RemoteExecutor / the executor server) they are converted at the
boundary. Building a 256-sequence decode plan as dataclasses costs about 0.2 us against
about 38 us to build and read the protobuf message (bench/RESULTS.md), so the in-process
path does not pay for the wire format. Field names match executor.proto one to one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protos.tandem.v1 import executor_pb2 as pb


@dataclass(slots=True)
class StepSamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int = 0
    num_prompt_tokens: int = 0
    # The features below travel only with the sequences that use them (empty columns otherwise).
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)  # with min_tokens only
    logit_bias_token_ids: list[int] = field(default_factory=list)
    logit_bias_values: list[float] = field(default_factory=list)
    prompt_logprobs: int | None = None


@dataclass(slots=True)
class NewSequence:
    seq_id: int
    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    sampling_params: StepSamplingParams


@dataclass(slots=True)
class StepPlan:
    """One engine step. The executor applies it in this order, after validating all of it
    (a plan that fails validation changes no state):

    1. drop the state of `finished_seq_ids` and `preempted_seq_ids`;
    2. register `new_seqs` (an id the executor already holds is an error); a new sequence's
       `block_table` is complete for this step and its `num_new_blocks` entry is 0;
    3. for each scheduled entry i: extend the block table with its new blocks, check that
       `num_computed_tokens[i]` equals the executor's own count, and compute tokens
       `token_ids[c : c + num_scheduled_tokens[i]]` (c = num_computed_tokens), which must
       all be known (c + n <= len(token_ids));
    4. every sequence whose computed count reaches len(token_ids) samples one token, which
       the executor appends to its own token_ids (a decode entry is then n = 1 next step).
       A chunk of a longer prefill samples nothing.
    """

    step_id: int
    new_seqs: list[NewSequence] = field(default_factory=list)
    # The scheduled batch as columns, one entry per sequence, in batch order.
    seq_ids: list[int] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # Blocks appended to each block table this step: flattened, num_new_blocks per entry.
    new_block_ids: list[int] = field(default_factory=list)
    num_new_blocks: list[int] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    preempted_seq_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class TokenLogprobs:
    seq_id: int
    sampled_logprobs: list[float]
    # Top-N alternatives, flattened, N per sampled token.
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class PromptLogprobs:
    """The prompt tokens token_ids[first_token_index : first_token_index + k] as one step scored them."""

    seq_id: int
    first_token_index: int
    token_logprobs: list[float]
    ranks: list[int]
    # Top-N alternatives, flattened, N per scored token.
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class StepResult:
    step_id: int
    seq_ids: list[int] = field(default_factory=list)
    # Sampled tokens, flattened, num_tokens per entry of seq_ids.
    token_ids: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prepare_seconds: float = 0.0
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)


@dataclass(slots=True)
class ExecutorInfo:
    """What `describe()` reports: the executor's capacity and the model's limits."""

    model: str
    architecture: str
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    tensor_parallel_size: int
    dtype: str
    device: str
    max_num_seqs: int
    max_num_batched_tokens: int
    attention_backend: str
    num_layers: int
    block_bytes: int
    kv_cache_dtype: str = ""  # "fp8_e4m3" or a torch dtype name; "" from an older executor


# -- protobuf conversion (used only at the gRPC boundary) --------------------------------


def _sampling_to_proto(p: StepSamplingParams) -> pb.StepSamplingParams:
    msg = pb.StepSamplingParams(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        logprobs=p.logprobs,
        num_prompt_tokens=p.num_prompt_tokens,
        min_tokens=p.min_tokens,
        stop_token_ids=p.stop_token_ids,
        logit_bias_token_ids=p.logit_bias_token_ids,
        logit_bias_values=p.logit_bias_values,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    return msg


def _sampling_from_proto(msg: pb.StepSamplingParams) -> StepSamplingParams:
    return StepSamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        repetition_penalty=msg.repetition_penalty,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        logprobs=msg.logprobs,
        num_prompt_tokens=msg.num_prompt_tokens,
        min_tokens=msg.min_tokens,
        stop_token_ids=msg.stop_token_ids[:],
        logit_bias_token_ids=msg.logit_bias_token_ids[:],
        logit_bias_values=msg.logit_bias_values[:],
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
    )


def plan_to_proto(plan: StepPlan) -> pb.StepPlan:
    # (the comprehensions of new sequences and logprobs, here and in result_from_proto, run only
    # when there are any: most steps have none, and each empty one cost a frame and an iterator)
    return pb.StepPlan(
        step_id=plan.step_id,
        new_seqs=[
            pb.NewSequence(
                seq_id=s.seq_id,
                token_ids=s.token_ids,
                block_table=s.block_table,
                num_computed_tokens=s.num_computed_tokens,
                sampling_params=_sampling_to_proto(s.sampling_params),
            )
            for s in plan.new_seqs
        ]
        if plan.new_seqs
        else (),
        seq_ids=plan.seq_ids,
        num_scheduled_tokens=plan.num_scheduled_tokens,
        num_computed_tokens=plan.num_computed_tokens,
        new_block_ids=plan.new_block_ids,
        num_new_blocks=plan.num_new_blocks,
        finished_seq_ids=plan.finished_seq_ids,
        preempted_seq_ids=plan.preempted_seq_ids,
    )


def plan_from_proto(msg: pb.StepPlan) -> StepPlan:
    return StepPlan(
        step_id=msg.step_id,
        new_seqs=[
            NewSequence(
                seq_id=s.seq_id,
                token_ids=s.token_ids[:],
                block_table=s.block_table[:],
                num_computed_tokens=s.num_computed_tokens,
                sampling_params=_sampling_from_proto(s.sampling_params),
            )
            for s in msg.new_seqs
        ],
        seq_ids=msg.seq_ids[:],
        num_scheduled_tokens=msg.num_scheduled_tokens[:],
        num_computed_tokens=msg.num_computed_tokens[:],
        new_block_ids=msg.new_block_ids[:],
        num_new_blocks=msg.num_new_blocks[:],
        finished_seq_ids=msg.finished_seq_ids[:],
        preempted_seq_ids=msg.preempted_seq_ids[:],
    )


def result_to_proto(result: StepResult) -> pb.StepResult:
    return pb.StepResult(
        step_id=result.step_id,
        seq_ids=result.seq_ids,
        token_ids=result.token_ids,
        num_tokens=result.num_tokens,
        logprobs=[
            pb.TokenLogprobs(
                seq_id=lp.seq_id,
                sampled_logprobs=lp.sampled_logprobs,
                top_token_ids=lp.top_token_ids,
                top_logprobs=lp.top_logprobs,
            )
            for lp in result.logprobs
        ],
        prepare_seconds=result.prepare_seconds,
        forward_seconds=result.forward_seconds,
        sample_seconds=result.sample_seconds,
        prompt_logprobs=[
            pb.PromptLogprobs(
                seq_id=p.seq_id,
                first_token_index=p.first_token_index,
                token_logprobs=p.token_logprobs,
                ranks=p.ranks,
                top_token_ids=p.top_token_ids,
                top_logprobs=p.top_logprobs,
            )
            for p in result.prompt_logprobs
        ],
    )


def result_from_proto(msg: pb.StepResult) -> StepResult:
    return StepResult(
        step_id=msg.step_id,
        seq_ids=msg.seq_ids[:],
        token_ids=msg.token_ids[:],
        num_tokens=msg.num_tokens[:],
        logprobs=[
            TokenLogprobs(
                seq_id=lp.seq_id,
                sampled_logprobs=lp.sampled_logprobs[:],
                top_token_ids=lp.top_token_ids[:],
                top_logprobs=lp.top_logprobs[:],
            )
            for lp in msg.logprobs
        ]
        if msg.logprobs
        else [],
        prepare_seconds=msg.prepare_seconds,
        forward_seconds=msg.forward_seconds,
        sample_seconds=msg.sample_seconds,
        prompt_logprobs=[
            PromptLogprobs(
                seq_id=p.seq_id,
                first_token_index=p.first_token_index,
                token_logprobs=p.token_logprobs[:],
                ranks=p.ranks[:],
                top_token_ids=p.top_token_ids[:],
                top_logprobs=p.top_logprobs[:],
            )
            for p in msg.prompt_logprobs
        ]
        if msg.prompt_logprobs
        else [],
    )


def info_to_proto(info: ExecutorInfo) -> pb.DescribeResponse:
    return pb.DescribeResponse(
        model=info.model,
        architecture=info.architecture,
        block_size=info.block_size,
        num_kv_blocks=info.num_kv_blocks,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids,
        tensor_parallel_size=info.tensor_parallel_size,
        dtype=info.dtype,
        device=info.device,
        max_num_seqs=info.max_num_seqs,
        max_num_batched_tokens=info.max_num_batched_tokens,
        attention_backend=info.attention_backend,
        num_layers=info.num_layers,
        block_bytes=info.block_bytes,
        kv_cache_dtype=info.kv_cache_dtype,
    )


def info_from_proto(msg: pb.DescribeResponse) -> ExecutorInfo:
    return ExecutorInfo(
        model=msg.model,
        architecture=msg.architecture,
        block_size=msg.block_size,
        num_kv_blocks=msg.num_kv_blocks,
        max_model_len=msg.max_model_len,
        vocab_size=msg.vocab_size,
        eos_token_ids=msg.eos_token_ids[:],
        tensor_parallel_size=msg.tensor_parallel_size,
        dtype=msg.dtype,
        device=msg.device,
        max_num_seqs=msg.max_num_seqs,
        max_num_batched_tokens=msg.max_num_batched_tokens,
        attention_backend=msg.attention_backend,
        num_layers=msg.num_layers,
        block_bytes=msg.block_bytes,
        kv_cache_dtype=msg.kv_cache_dtype,
    )
