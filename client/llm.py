"""Offline, in-process generation: the scheduler core and a LocalExecutor in one process.

llm = LLM("path/to/qwen3")
outputs = llm.generate(["The list type"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from protos.defaults import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS
from scheduler_service.config import DEFAULT_MAX_LOGPROBS, SchedulerConfig
from scheduler_service.engine import LLMEngine, RequestOutput
from scheduler_service.request_handling import OutputProcessor, tokenize, verify_tokenizer
from scheduler_service.sampling_params import SamplingParams
from scheduler_service.sequence import TokenLogprob
from scheduler_service.tokenizer import Tokenizer

Prompt = str | list[int]
NO_TOKENIZER = "this model has no tokenizer.json: pass token ids instead of text"


@dataclass
class GenerationOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    num_cached_tokens: int
    # One entry per generated token when the request asked for logprobs.
    logprobs: list[TokenLogprob] | None = None


class LLM:
    """A checkpoint directory (or a hub id in the local cache) served in-process. Executor options
    are `ExecutorConfig` fields."""

    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | None = None,
        max_num_seqs: int = MAX_NUM_SEQS,
        max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        max_plans_in_flight: int | None = None,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        max_prefill_tokens_while_decoding: int = 0,
        **executor_options,
    ):
        # Imported here: torch loads when an LLM is made, not when this module is imported.
        from executor_service.config import ExecutorConfig
        from executor_service.executor import LocalExecutor

        self.executor = LocalExecutor(
            ExecutorConfig(
                model=model,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                **executor_options,
            )
        )
        self.engine = LLMEngine(
            self.executor,
            SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_prefix_caching=enable_prefix_caching,
                max_plans_in_flight=max_plans_in_flight,
                max_logprobs=max_logprobs,
                max_prefill_tokens_while_decoding=max_prefill_tokens_while_decoding,
            ),
        )
        # The executor resolved a hub id to its cached snapshot.
        tokenizer_path = tokenizer or self.executor.config.model
        self.tokenizer = Tokenizer(tokenizer_path) if Tokenizer.exists(tokenizer_path) else None

    def _encode(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        if isinstance(prompt, str):
            return tokenize(self.tokenizer, prompt, params, self.engine.limits.max_model_len, NO_TOKENIZER)
        return list(prompt)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[GenerationOutput]:
        """Generate for every prompt at once (continuous batching); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")

        # Validate and encode everything before admitting anything: a bad prompt fails alone.
        for sp in sampling_params:
            verify_tokenizer(sp, self.tokenizer, NO_TOKENIZER)
        encoded = [self._encode(p, sp) for p, sp in zip(prompts, sampling_params)]
        for ids, sp in zip(encoded, sampling_params):
            self.engine.validate_request(ids, sp)
        request_ids = [self.engine.add_request(ids, sp) for ids, sp in zip(encoded, sampling_params)]
        order = {rid: i for i, rid in enumerate(request_ids)}
        # Requests with stop strings are detokenized as they go, to end them at the first one;
        # the others are decoded once, at the end.
        streams = {
            rid: _TextStream(self.tokenizer, sp) for rid, sp in zip(request_ids, sampling_params) if sp.stop
        }
        finished: dict[int, GenerationOutput] = {}
        bar = tqdm(total=len(prompts), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        stats = self.engine.scheduler.stats
        while self.engine.has_unfinished_requests():
            prompt_before, gen_before = stats.num_prompt_tokens, stats.num_generation_tokens
            t0 = time.perf_counter()
            outputs = self.engine.step()
            dt = max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix(
                prefill=f"{(stats.num_prompt_tokens - prompt_before) / dt:.0f}tok/s",
                decode=f"{(stats.num_generation_tokens - gen_before) / dt:.0f}tok/s",
            )
            for out in outputs:
                rid = out.request_id
                if rid not in order or rid in finished:
                    continue
                stream = streams.get(rid)
                if stream is not None and stream.add(out):
                    self.engine.abort_request(rid)  # a stop string ended it
                elif not out.finished:
                    continue
                finished[rid] = self._output(out, stream)
                bar.update(1)
        bar.close()

        results = []
        for prompt, ids, rid in zip(prompts, encoded, request_ids):
            result = finished[rid]
            result.prompt = prompt if isinstance(prompt, str) else None
            result.prompt_token_ids = ids
            results.append(result)
        return results

    def _output(self, out: RequestOutput, stream: _TextStream | None) -> GenerationOutput:
        if stream is None:
            token_ids = list(out.token_ids)
            text = self.tokenizer.decode(token_ids) if self.tokenizer is not None else None
            reason, logprobs = out.finish_reason, out.logprobs
        else:
            n = stream.processor.num_tokens
            token_ids, text = list(out.token_ids[:n]), "".join(stream.text)
            reason, _ = stream.processor.finish(out.finish_reason, None)
            logprobs = out.logprobs[:n] if out.logprobs is not None else None
        return GenerationOutput(None, [], token_ids, text, reason, out.num_cached_tokens, logprobs)


class _TextStream:
    """The text of a request with stop strings, as it is generated."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.processor = OutputProcessor(tokenizer, params)
        self.text: list[str] = []

    def add(self, out: RequestOutput) -> bool:
        """Whether a stop string ended the request."""
        delta = self.processor.add(out.new_token_ids, out.finished)
        self.text.append(delta.text)
        return delta.stopped
