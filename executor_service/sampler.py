"""Token sampling: logit bias, min_tokens, penalties, greedy / temperature, min-p, top-k, top-p,
per-request seeds, logprobs.

Semantics follow vLLM: the logit bias is added and the stop tokens of a sequence short of its
min_tokens are banned first (on both paths: the fused one samples the biased logits); then the
repetition penalty over prompt + generated tokens (divide positive logits, multiply negative ones),
presence and frequency penalties over generated tokens, then temperature, min-p, top-k and top-p.
Logprobs are computed from the model's raw logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_service.sampling_metadata import MIN_TEMPERATURE, SamplingMetadata

# The repetition penalty's results are kept within +-this: a penalty near 0 (or huge) overflows
# the seen tokens' logits to +-inf, and a row with two +inf has no softmax (inf - inf). Far past
# any model's logit, and finite still once divided by the smallest temperature.
_PENALISED_BOUND = 1e-3 * torch.finfo(torch.float32).max * MIN_TEMPERATURE


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [n] int64
    # Present when some row asked for logprobs.
    sampled_logprobs: torch.Tensor | None = None  # [n]
    top_token_ids: torch.Tensor | None = None  # [n, max_num_logprobs]
    top_logprobs: torch.Tensor | None = None  # [n, max_num_logprobs]


class Sampler:
    def __init__(self, seed: int, device: torch.device, fused: bool = False) -> None:
        self.device = device
        # One generator for every row without a request seed.
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # fused: greedy and plain temperature rows in one Triton pass (sampling_kernel.py).
        self.fused = fused

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # logits: [n, vocab_size]
        # Seeded rows keep the unfused path's noise, so that a seeded request's tokens do not
        # depend on which path the rest of its batch takes.
        fused = self.fused and meta.temperature_only and not meta.seeded_rows
        if meta.logit_bias is None and meta.banned_tokens is None:
            if fused:  # the kernel reads the logits in their own dtype
                return SamplerOutput(self._sample_fused(logits, meta))
            raw = logits = logits.float()
        else:
            raw = logits.float()
            logits = apply_logit_bias(raw, meta)
            if fused:
                return SamplerOutput(self._sample_fused(logits, meta))
        raw_logprobs = raw.log_softmax(-1) if meta.max_num_logprobs > 0 else None
        if meta.repetition_penalties is not None:
            logits = apply_penalties(logits, meta)
        greedy = logits.argmax(-1)
        if meta.all_greedy:
            sampled = greedy
        else:
            sampled = torch.where(meta.temperatures == 0, greedy, self._sample(logits, meta))
        out = SamplerOutput(sampled)
        if raw_logprobs is not None:
            out.sampled_logprobs = raw_logprobs.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
            out.top_logprobs, out.top_token_ids = raw_logprobs.topk(meta.max_num_logprobs, dim=-1)
        return out

    def _sample_fused(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        from executor_service.sampling_kernel import sample_from_logits

        # A fresh Philox seed per row from the device generator: no host work, no copy.
        seeds = torch.randint(2**62, (logits.shape[0],), generator=self.generator, device=self.device)
        return sample_from_logits(logits, meta.temperatures, seeds)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        temperatures = torch.where(meta.temperatures == 0, 1.0, meta.temperatures)
        logits = logits / temperatures.unsqueeze(-1)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = logits.softmax(-1)
        # Exponential race: argmax(p / E), E ~ Exp(1), draws from p without a device sync.
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, seed in meta.seeded_rows:
            g = torch.Generator(device=self.device).manual_seed(seed)
            q[row].exponential_(generator=g)
        return (probs / q.clamp_min_(1e-20)).argmax(-1)


def apply_logit_bias(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """A new tensor (the model's logits stay as they were): the rows' biases added, then their
    banned tokens at -inf."""
    if meta.logit_bias is not None:
        rows, ids, biases = meta.logit_bias
        logits = logits.index_put((rows, ids), biases, accumulate=True)
    if meta.banned_tokens is not None:
        rows, ids = meta.banned_tokens
        # (a fill on the device: a scalar copied from the host would wait for the GPU)
        logits = logits.index_put((rows, ids), logits.new_full((), float("-inf")))
    return logits


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    n, vocab_size = logits.shape
    # Padding ids equal vocab_size land in an extra column that is dropped.
    output_counts = torch.zeros(n, vocab_size + 1, device=logits.device)
    output_counts.scatter_add_(
        1, meta.output_token_ids, torch.ones_like(meta.output_token_ids, dtype=torch.float)
    )
    output_counts = output_counts[:, :vocab_size]
    prompt_mask = torch.zeros(n, vocab_size + 1, dtype=torch.bool, device=logits.device)
    prompt_mask.scatter_(1, meta.prompt_token_ids, True)
    seen = prompt_mask[:, :vocab_size] | (output_counts > 0)
    rep = torch.where(seen, meta.repetition_penalties.unsqueeze(-1), 1.0)
    penalised = torch.where(logits > 0, logits / rep, logits * rep).clamp_(
        -_PENALISED_BOUND, _PENALISED_BOUND
    )
    logits = torch.where(logits == float("-inf"), logits, penalised)  # (a banned token stays banned)
    logits = logits - meta.frequency_penalties.unsqueeze(-1) * output_counts
    return logits - meta.presence_penalties.unsqueeze(-1) * (output_counts > 0)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(-1)
    threshold = min_p.unsqueeze(-1) * probs.amax(-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's top_k tokens (and any tied with the k-th, as vLLM's), then the smallest set of
    those whose probability reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_logits.gather(-1, (top_k - 1).unsqueeze(-1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(-1), float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
