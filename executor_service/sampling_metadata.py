"""Per-row sampling parameters of one step as device tensors, built on the host in one pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_service.sequence import SequenceState
from protos.plan import StepSamplingParams

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): the distribution is the argmax's
# to within rounding, and dividing logits by a tiny one (1e-38) overflows them to inf, whose softmax
# is NaN (every such row sampled token 0).
MIN_TEMPERATURE = 1e-5


def _temperature(params: StepSamplingParams) -> float:
    """The temperature a row samples at: 0 (greedy) below MIN_TEMPERATURE."""
    return params.temperature if params.temperature >= MIN_TEMPERATURE else 0.0


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    pin = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)


def uses_penalties(params: StepSamplingParams) -> bool:
    """Whether sampling reads the sequence's generated tokens (repetition / presence /
    frequency penalties)."""
    return params.repetition_penalty != 1 or params.presence_penalty != 0 or params.frequency_penalty != 0


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return _to_device([r + [pad] * (width - len(r)) for r in rows], torch.long, device)


@dataclass
class SamplingMetadata:
    temperatures: torch.Tensor  # [n] float32, 0 = greedy
    top_k: torch.Tensor | None  # [n] int64, vocab_size = off; None when no row uses it
    top_p: torch.Tensor | None  # [n] float32
    min_p: torch.Tensor | None  # [n] float32
    all_greedy: bool
    # (row, generator seed) for rows with a request seed.
    seeded_rows: list[tuple[int, int]]
    # Penalties, None when no row uses any.
    repetition_penalties: torch.Tensor | None = None  # [n]
    presence_penalties: torch.Tensor | None = None  # [n]
    frequency_penalties: torch.Tensor | None = None  # [n]
    prompt_token_ids: torch.Tensor | None = None  # [n, max_prompt], padded with vocab_size
    output_token_ids: torch.Tensor | None = None  # [n, max_output], padded with vocab_size
    max_num_logprobs: int = 0
    num_logprobs: tuple[int, ...] = ()
    # Rows' logit_bias as (rows, token ids, biases), [k] each; None when no row has one.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Stop tokens of rows short of their min_tokens as (rows, token ids), [k] each: banned.
    banned_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    # The rows' parameters, when nothing above depends on more than them (no seeded row, no
    # penalties, logit bias or min_tokens): then a step whose rows have the same parameters reuses
    # this metadata as it is (build's `previous`). Empty otherwise.
    params: tuple[StepSamplingParams, ...] = ()

    @property
    def temperature_only(self) -> bool:
        """No row needs more than its temperature (the fused sampler's case)."""
        return (
            self.top_k is None
            and self.top_p is None
            and self.min_p is None
            and self.repetition_penalties is None
            and self.max_num_logprobs == 0
        )

    @classmethod
    def build(
        cls,
        seqs: list[SequenceState],
        vocab_size: int,
        device: torch.device,
        bias_logits: bool = True,
        previous: SamplingMetadata | None = None,
    ) -> SamplingMetadata:
        """`bias_logits`: whether a row may have a logit bias or min_tokens (False skips the look).
        `previous`: the metadata of the step before, returned as it is when it depends on its rows'
        parameters only and this step's rows have the same ones (most decode steps: the same
        sequences in the same order), which spares the host a pass over the rows and a copy per
        tensor."""
        params = [s.sampling_params for s in seqs]
        if (
            previous is not None
            and len(previous.params) == len(params) > 0
            and all(a is b for a, b in zip(previous.params, params))
        ):
            return previous
        temperatures = [_temperature(p) for p in params]
        all_greedy = all(t == 0 for t in temperatures)
        random = [p for p, t in zip(params, temperatures, strict=True) if t > 0]
        top_k = top_p = min_p = None
        if any(0 < p.top_k < vocab_size for p in random):
            top_k = _to_device(
                [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], torch.long, device
            )
        if any(p.top_p < 1 for p in random):
            top_p = _to_device([p.top_p for p in params], torch.float32, device)
        if any(p.min_p > 0 for p in random):
            min_p = _to_device([p.min_p for p in params], torch.float32, device)
        seeded = [
            (i, mix_seed(p.seed, s.num_tokens))
            for i, (s, p, t) in enumerate(zip(seqs, params, temperatures, strict=True))
            if p.seed is not None and t > 0
        ]
        num_logprobs = tuple(p.logprobs for p in params)
        meta = cls(
            temperatures=_to_device(temperatures, torch.float32, device),
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            all_greedy=all_greedy,
            seeded_rows=seeded,
            max_num_logprobs=max(num_logprobs, default=0),
            num_logprobs=num_logprobs,
        )
        rows = (
            [i for i, p in enumerate(params) if p.logit_bias_token_ids or p.min_tokens] if bias_logits else []
        )
        if rows:
            meta.logit_bias, meta.banned_tokens = _biases_and_bans(seqs, rows, device)
        if any(uses_penalties(p) for p in params):
            meta.repetition_penalties = _to_device(
                [p.repetition_penalty for p in params], torch.float32, device
            )
            meta.presence_penalties = _to_device([p.presence_penalty for p in params], torch.float32, device)
            meta.frequency_penalties = _to_device(
                [p.frequency_penalty for p in params], torch.float32, device
            )
            meta.prompt_token_ids = _padded(
                [s.token_ids[: s.num_prompt_tokens] for s in seqs], vocab_size, device
            )
            meta.output_token_ids = _padded(
                [s.token_ids[s.num_prompt_tokens :] for s in seqs], vocab_size, device
            )
        elif not seeded and not any(p.logit_bias_token_ids or p.min_tokens for p in params):
            meta.params = tuple(params)
        return meta


def _biases_and_bans(seqs: list[SequenceState], rows: list[int], device: torch.device) -> tuple:
    """(logit_bias, banned_tokens) of SamplingMetadata for the rows that have either."""
    bias_rows, bias_ids, biases, ban_rows, ban_ids = [], [], [], [], []
    for i in rows:
        seq = seqs[i]
        p = seq.sampling_params
        bias_rows += [i] * len(p.logit_bias_token_ids)
        bias_ids += p.logit_bias_token_ids
        biases += p.logit_bias_values
        # Tokens generated so far: the one sampled now is token number num_generated + 1.
        if seq.num_tokens - seq.num_prompt_tokens < p.min_tokens:
            ban_rows += [i] * len(p.stop_token_ids)
            ban_ids += p.stop_token_ids
    bias = ban = None
    if bias_rows:
        bias = (
            _to_device(bias_rows, torch.long, device),
            _to_device(bias_ids, torch.long, device),
            _to_device(biases, torch.float32, device),
        )
    if ban_rows:
        ban = (_to_device(ban_rows, torch.long, device), _to_device(ban_ids, torch.long, device))
    return bias, ban


def mix_seed(seed: int, num_tokens: int) -> int:
    """A 64-bit generator seed from (request seed, tokens so far): splitmix64 of their combination,
    so a seeded row's draw depends on nothing else in the batch and survives preemption."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + num_tokens + 0x632BE59BD9B4E019) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)
