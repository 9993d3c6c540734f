"""Offline, in-process generation: the scheduler core and a LocalExecutor in one process.

llm = LLM("path/to/qwen3")
outputs = llm.generate(["The list type"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import dataclasses
import itertools
import reprlib
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from tqdm import tqdm

from protos.defaults import MAX_NUM_SEQS, offline_max_num_batched_tokens
from scheduler_service.chat_template import ChatTemplate
from scheduler_service.config import DEFAULT_MAX_LOGPROBS, SchedulerConfig
from scheduler_service.detokenizer import decode_after, prompt_context
from scheduler_service.engine import LLMEngine
from scheduler_service.engine import RequestOutput as EngineOutput
from scheduler_service.errors import InvalidRequestError
from scheduler_service.request_handling import (
    OutputProcessor,
    finish_reasons,
    name_tokens,
    tokenize,
    verify_tokenizer,
)
from scheduler_service.request_handling import chat_template as request_chat_template
from scheduler_service.sampling_params import SamplingParams, truncate_prompt
from scheduler_service.sequence import TokenLogprob
from scheduler_service.tokenizer import Tokenizer

Prompt = str | list[int]
NO_TOKENIZER = "this model has no tokenizer.json: pass token ids instead of text"
SKIPPED_TOKENIZER = "this LLM has no tokenizer (skip_tokenizer_init=True): pass token ids instead of text"
# vLLM's tokenizer modes that mean this LLM's one tokenizer (tokenizer.json, read by the `tokenizers`
# library as vLLM's fast tokenizers are).
TOKENIZER_MODES = ("auto", "hf")
# vLLM's chat_template_content_format values that are how chat() renders content: text parts joined
# into one string ("openai", the list of parts as it is, is not).
CONTENT_FORMATS = ("auto", "string")


@dataclass
class Logprob:
    """vLLM's: a token's logprob, its rank in the vocabulary (1: the most likely; None where it is
    not known: a sampled token outside the top alternatives asked for) and its text (None
    without a tokenizer, or with detokenize off)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class PositionLogprobs(dict):
    """One position's logprobs as vLLM's outputs give them, token id -> Logprob: the chosen token's
    first, then its top alternatives best first (the chosen token once, where it is among them).
    The TokenLogprob's fields (token_id, logprob, top_logprobs, rank, token, top_tokens), which the
    services' clients give, are its attributes too (set by of())."""

    @classmethod
    def of(cls, lp: TokenLogprob) -> PositionLogprobs:
        tops = lp.top_tokens or [None] * len(lp.top_logprobs)
        rank = lp.rank
        if rank is None:  # (a sampled token: its place among the top alternatives, if it is there)
            rank = next((k for k, (t, _) in enumerate(lp.top_logprobs, 1) if t == lp.token_id), None)
        position = cls({lp.token_id: Logprob(lp.logprob, rank, lp.token)})
        for k, ((t, logprob), text) in enumerate(zip(lp.top_logprobs, tops), 1):
            position.setdefault(t, Logprob(logprob, k, text))
        position.token_id, position.logprob, position.rank = lp.token_id, lp.logprob, lp.rank
        position.top_logprobs, position.token, position.top_tokens = lp.top_logprobs, lp.token, lp.top_tokens
        return position


@dataclass
class CompletionOutput:
    """One of a prompt's n samples (vLLM's name)."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str
    # One entry per generated token when the request asked for logprobs (with the tokens' text
    # when there is a tokenizer).
    logprobs: list[PositionLogprobs] | None = None
    # The stop string (a str) or stop token id (an int) that ended it; None otherwise.
    stop_reason: str | int | None = None
    # The sum of the sampled tokens' logprobs, when the request asked for logprobs.
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A prompt's generation (vLLM's name): its samples in `outputs` (one unless
    SamplingParams.n > 1); token_ids, text, finish_reason and logprobs are the first sample's."""

    prompt: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int
    outputs: list[CompletionOutput]
    # With prompt_logprobs: None for the first prompt token (nothing precedes it), then one
    # entry per prompt token.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Unique within the LLM ("0", "1", ..., as vLLM's offline ids).
    request_id: str = ""
    # generate() returns finished requests only.
    finished: bool = True

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[PositionLogprobs] | None:
        return self.outputs[0].logprobs


def _offline_budget(device: object) -> int:
    """The default step budget for the executor's device (its first rank's GPU on CUDA)."""
    import torch

    device = str(device)
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return offline_max_num_batched_tokens(None)
    try:
        props = torch.cuda.get_device_properties(torch.device(device))
    except (RuntimeError, ValueError, AssertionError):  # a device torch does not have: the config says so
        return offline_max_num_batched_tokens(None)
    return offline_max_num_batched_tokens(props.total_memory, props.name)


class LLM:
    """A checkpoint directory (or a hub id in the local cache) served in-process. Executor options
    are `ExecutorConfig` fields. max_num_batched_tokens None: 16,384 on a CUDA GPU of 70 GiB or more
    other than an A100, else 8,192, as vLLM's LLM class (protos.defaults.offline_max_num_batched_tokens).

    vLLM's arguments as vLLM's LLM takes them: dtype "auto" (or None) is the checkpoint's; seed
    None a fresh random one (unseeded requests then differ from run to run); tokenizer_mode "auto"
    or "hf" (this LLM's one tokenizer); skip_tokenizer_init: no tokenizer (prompts as token ids,
    outputs without text); trust_remote_code is taken either way (only the built-in
    architectures run, never a checkpoint's own code). Any other argument is a TypeError."""

    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | None = None,
        tokenizer_mode: str = "auto",
        skip_tokenizer_init: bool = False,
        trust_remote_code: bool = False,
        dtype: str | None = "auto",
        seed: int | None = 0,
        max_num_seqs: int = MAX_NUM_SEQS,
        max_num_batched_tokens: int | None = None,
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

        _check_executor_options(ExecutorConfig, executor_options)
        if tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(
                f"tokenizer_mode {tokenizer_mode!r} is not taken: this LLM reads tokenizer.json with the "
                f"`tokenizers` library (vLLM's fast tokenizers), which is {' or '.join(map(repr, TOKENIZER_MODES))}"
            )
        # A tokenizer asked for is read first: one that is not there is an error before the model
        # loads (and before an executor is left running behind it).
        self.tokenizer = Tokenizer(tokenizer) if tokenizer is not None and not skip_tokenizer_init else None
        if max_num_batched_tokens is None:
            max_num_batched_tokens = _offline_budget(executor_options.get("device", "cpu"))
        self.executor = LocalExecutor(
            ExecutorConfig(
                model=model,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                dtype=None if dtype == "auto" else dtype,
                seed=secrets.randbits(63) if seed is None else seed,
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
        # The executor resolved a hub id to its cached snapshot. Without a tokenizer asked for, a
        # checkpoint without tokenizer.json takes token ids only.
        if tokenizer is None and not skip_tokenizer_init:
            model = self.executor.config.model
            self.tokenizer = Tokenizer(model) if Tokenizer.exists(model) else None
        # What needs a tokenizer (a text prompt, a chat, stop strings) is refused with this.
        self._no_tokenizer = SKIPPED_TOKENIZER if skip_tokenizer_init else NO_TOKENIZER
        # vLLM's offline request ids: "0", "1", ... one per prompt, counted over the LLM's calls.
        self._request_ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer | None:
        """The tokenizer (None for a checkpoint without tokenizer.json)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() sample with when given none (vLLM's method): SamplingParams'
        defaults (greedy; vLLM's are the checkpoint's generation_config.json's)."""
        return SamplingParams()

    def _encode(self, prompt: Prompt, params: SamplingParams, add_special_tokens: bool) -> list[int]:
        """The prompt's token ids, cut to its last truncate_prompt_tokens (RequestOutput's
        prompt_token_ids are these, as vLLM's)."""
        max_model_len = self.engine.limits.max_model_len
        if isinstance(prompt, str):
            ids = tokenize(
                self.tokenizer, prompt, params, max_model_len, self._no_tokenizer, add_special_tokens
            )
        else:
            ids = list(prompt)
        return truncate_prompt(ids, params, max_model_len)

    def generate(
        self,
        prompts: Prompt | dict | Sequence[Prompt | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        *,
        lora_request: object = None,
        on_text: Callable[[str], object] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt at once (continuous batching); outputs in prompt order.
        `use_tqdm`: show a progress bar, or (as vLLM's) a callable that makes one (tqdm's
        arguments). `on_text`, if given, is called with each piece of the first prompt's text (its
        first sample's) as it is generated, the pieces adding up to that output's `text` (never
        called for a model without a tokenizer, whose outputs are token ids). `lora_request`: vLLM's,
        None only (no LoRA adapters here)."""
        _refuse_lora(lora_request)
        given = _prompt_list(prompts)
        parsed = [_prompt(prompt, f"prompts[{i}]") for i, prompt in enumerate(given)]
        texts = [_prompt_text(prompt) for prompt in given]
        return self._generate(parsed, sampling_params, use_tqdm, on_text=on_text, texts=texts)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        *,
        lora_request: object = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or to a list of them, each
        rendered with the checkpoint's chat template (or `chat_template`, a Jinja source) as the
        HTTP API's chat completions render theirs; the text is tokenized without special tokens (the
        template writes its own). With continue_final_message (and add_generation_prompt off) the
        prompt ends inside the final message, which the model continues. A message's content parts
        reach the template as one string (vLLM's chat_template_content_format "string", which its
        "auto" picks for a template of text). InvalidRequestError for messages the template refuses."""
        from scheduler_service.openai_protocol import ChatRequest  # (pydantic: only for chat)

        _refuse_lora(lora_request)
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(
                f"chat_template_content_format {chat_template_content_format!r} is not taken: content "
                f"parts reach the chat template joined into one string ({' or '.join(map(repr, CONTENT_FORMATS))})"
            )
        one = isinstance(messages, (list, tuple)) and (not messages or isinstance(messages[0], dict))
        conversations = [messages] if one else messages
        if not isinstance(conversations, (list, tuple)):
            raise TypeError(
                f"messages must be a list of messages or a list of those, got {reprlib.repr(messages)}"
            )
        if chat_template is None:
            template = request_chat_template(self.tokenizer, self._no_tokenizer)
        elif self.tokenizer is None:
            raise InvalidRequestError(self._no_tokenizer)
        else:  # (vLLM's way to chat with a base model, whose checkpoint has no template)
            template = ChatTemplate.given(chat_template, self.tokenizer.path)
        prompts: list[Prompt] = []
        for conversation in conversations:
            fields = {
                "messages": conversation,
                "tools": tools,
                "add_generation_prompt": add_generation_prompt,
                "continue_final_message": continue_final_message,
                "chat_template_kwargs": chat_template_kwargs,
            }
            request = ChatRequest.model_validate(fields, strict=False)  # (Python values: a tuple is a list)
            prompts.append(request.render(template))
        return self._generate(prompts, sampling_params, use_tqdm, add_special_tokens=False)

    def _generate(
        self,
        prompts: list[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool | Callable[..., tqdm],
        add_special_tokens: bool = True,
        on_text: Callable[[str], object] | None = None,
        texts: list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """`texts`: each prompt's RequestOutput.prompt (None: the prompt itself where it is a text)."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)) or not all(
            isinstance(sp, SamplingParams) for sp in sampling_params
        ):
            raise TypeError(
                f"sampling_params must be a SamplingParams or a list of them, got {reprlib.repr(sampling_params)}"
            )
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")

        # Validate and encode everything before admitting anything: a bad prompt fails alone.
        for sp in sampling_params:
            verify_tokenizer(sp, self.tokenizer, self._no_tokenizer)
        encoded = [self._encode(p, sp, add_special_tokens) for p, sp in zip(prompts, sampling_params)]
        for ids, sp in zip(encoded, sampling_params):
            self.engine.validate_request(ids, sp)
        # n samples of a prompt are n requests: (prompt index, sample index) of each.
        requests: dict[int, tuple[int, int, SamplingParams]] = {}
        streams: dict[int, _TextStream] = {}
        watched = None  # the request whose text goes to on_text
        finished: dict[int, CompletionOutput] = {}
        prompt_logprobs: dict[int, list[TokenLogprob]] = {}
        cached: dict[int, int] = {}
        total = sum(sp.n for sp in sampling_params)
        bar = (
            use_tqdm(total=total, desc="Generating", dynamic_ncols=True)
            if callable(use_tqdm)
            else tqdm(total=total, desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        )
        request_ids = []
        try:
            for i, (ids, sp) in enumerate(zip(encoded, sampling_params)):
                request_ids.append(str(next(self._request_ids)))
                # Checked above, each sample is admitted unchecked.
                for j, sample in enumerate(sp.for_samples()):
                    rid = self.engine.add_request(ids, sample, validated=True)
                    requests[rid] = (i, j, sample)
                    decoded = self.tokenizer is not None and sample.detokenize
                    if on_text is not None and decoded and (i, j) == (0, 0):
                        watched = rid
                    # Requests with stop strings are detokenized as they go, to end them at the
                    # first one, and so is the one streamed to on_text; the others are decoded once,
                    # at the end.
                    if sample.stop or rid == watched:
                        streams[rid] = _TextStream(self.tokenizer, sample, ids)
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
                    if rid not in requests or rid in finished:
                        continue
                    if out.prompt_logprobs is not None:
                        prompt_logprobs[requests[rid][0]] = out.prompt_logprobs
                    stream = streams.get(rid)
                    stopped = stream is not None and stream.add(out)
                    if rid == watched and stream.text[-1]:
                        on_text(stream.text[-1])
                    if stopped:
                        self.engine.abort_request(rid)  # a stop string ended it
                    elif not out.finished:
                        continue
                    i, j, sample = requests[rid]
                    finished[rid] = self._output(out, stream, j, sample, encoded[i])
                    if j == 0:  # the prompt's, as its first sample found it (as the servers' usage)
                        cached[i] = out.num_cached_tokens
                    bar.update(1)
        except BaseException:
            # An interrupt (Ctrl-C), on_text's error or the executor's: none of this call's requests
            # (those admitted so far) runs on into the next call, which would step them to their
            # end before its own.
            bar.close()
            for unfinished in requests.keys() - finished.keys():
                self.engine.abort_request(unfinished)
            raise
        bar.close()

        if texts is None:
            texts = [prompt if isinstance(prompt, str) else None for prompt in prompts]
        results = [
            RequestOutput(text, ids, cached.get(i, 0), [], request_id=rid)
            for i, (text, ids, rid) in enumerate(zip(texts, encoded, request_ids))
        ]
        for rid, (i, _, _) in requests.items():
            results[i].outputs.append(finished[rid])
        for i, lps in prompt_logprobs.items():
            results[i].prompt_logprobs = [None, *self._logprobs(lps, sampling_params[i])]
        return results

    def _output(
        self,
        out: EngineOutput,
        stream: _TextStream | None,
        index: int,
        params: SamplingParams,
        prompt_token_ids: list[int],
    ) -> CompletionOutput:
        token_ids = list(out.token_ids)
        logprobs = out.logprobs
        last = token_ids[-1] if token_ids else None
        if stream is None:
            # A stop token's text is left out, as OutputProcessor leaves it out of a stream.
            drop = out.finish_reason == "stop" and not params.include_stop_str_in_output
            text_ids = token_ids[:-1] if drop else token_ids
            text = None
            if not params.detokenize:
                text = ""  # (vLLM's)
            elif self.tokenizer is not None:  # (as the prompt's continuation, as a stream decodes it)
                skip = params.skip_special_tokens
                context = prompt_context(self.tokenizer, prompt_token_ids, skip)
                text = decode_after(self.tokenizer, context, text_ids, skip)
            # (vLLM's stop_reason: the stop token id as an int, None for an end-of-sequence token)
            reason, stop_reason = finish_reasons(params, out.finish_reason, last)
        else:
            n = stream.processor.num_tokens
            token_ids, text = token_ids[:n], "".join(stream.text)
            # (the stop string or the stop token id)
            reason, stop_reason = stream.processor.finish(out.finish_reason, last)
            logprobs = logprobs[:n] if logprobs is not None else None
        cumulative = None
        if logprobs is not None:
            cumulative = sum(lp.logprob for lp in logprobs)
            logprobs = self._logprobs(logprobs, params)
        return CompletionOutput(index, token_ids, text, reason, logprobs, stop_reason, cumulative)

    def _logprobs(self, logprobs: list[TokenLogprob], params: SamplingParams) -> list[PositionLogprobs]:
        """The engine's logprobs as vLLM's dicts, their tokens named unless detokenize is off."""
        if params.detokenize:
            name_tokens(self.tokenizer, logprobs)
        return [PositionLogprobs.of(lp) for lp in logprobs]

    def encode(self, *_args: object, **_kwargs: object) -> NoReturn:
        """vLLM's pooling API (encode, embed, classify, score, reward): not here."""
        _no_pooling("encode")

    def embed(self, *_args: object, **_kwargs: object) -> NoReturn:
        _no_pooling("embed")

    def classify(self, *_args: object, **_kwargs: object) -> NoReturn:
        _no_pooling("classify")

    def score(self, *_args: object, **_kwargs: object) -> NoReturn:
        _no_pooling("score")

    def reward(self, *_args: object, **_kwargs: object) -> NoReturn:
        _no_pooling("reward")


def _no_pooling(method: str) -> NoReturn:
    raise ValueError(
        f"LLM.{method}() is vLLM's pooling API, for embedding and classifier models; this LLM "
        "generates text only (generate(), chat())"
    )


def _refuse_lora(lora_request: object) -> None:
    """ValueError for a LoRA adapter (vLLM's lora_request: one, or one per prompt); None, or Nones, are taken."""
    requests = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request]
    if any(r is not None for r in requests):
        raise ValueError("LoRA adapters are not supported: lora_request must be None")


def _check_executor_options(config_class: type, options: dict[str, Any]) -> None:
    """TypeError, before anything loads, naming the keywords that are neither the LLM's own
    arguments nor executor options (`config_class`'s fields): vLLM's engine arguments that have no
    counterpart here (swap_space, tokenizer_revision, ...), say."""
    fields = {f.name for f in dataclasses.fields(config_class) if f.init}
    if unknown := [name for name in options if name not in fields]:
        raise TypeError(
            f"LLM() got unexpected keyword argument{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}: neither one of its own nor an executor option "
            f"({', '.join(sorted(fields - {'model'}))})"
        )


def _is_token_ids(prompt: object) -> bool:
    return isinstance(prompt, (list, tuple)) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    )


def _prompt_list(prompts: object) -> list[object]:
    """generate()'s prompts as a list, each for _prompt(); TypeError for what is not a prompt or a
    list of them."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
    ):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(
            "prompts must be a string, a list of token ids, a dict ({'prompt': text} or "
            f"{{'prompt_token_ids': ids}}), or a list of those, got {reprlib.repr(prompts)}"
        )
    return list(prompts)


def _prompt_text(prompt: object) -> str | None:
    """A prompt's text, as its RequestOutput.prompt gives it: a text prompt's, or the text a vLLM
    TokensPrompt carries beside its ids ("prompt", not tokenized); None for token ids alone."""
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def _prompt(prompt: object, name: str) -> Prompt:
    """A prompt as a text or a list of token ids; vLLM's TextPrompt ({"prompt": text}) and
    TokensPrompt ({"prompt_token_ids": ids}, a "prompt" text beside them, which is not tokenized)
    dicts are taken too. TypeError naming one that is none of these (checked before anything is
    admitted: a float id would fail inside the engine's step, with its request still in the
    engine)."""
    if isinstance(prompt, dict):
        if unknown := [k for k in prompt if k not in ("prompt", "prompt_token_ids")]:
            raise TypeError(f"{name} has keys this model does not take: {', '.join(map(repr, unknown))}")
        if "prompt" in prompt and not isinstance(prompt["prompt"], str):
            raise TypeError(f"{name}['prompt'] must be a string, got {reprlib.repr(prompt['prompt'])}")
        if "prompt_token_ids" in prompt:  # (vLLM's TokensPrompt)
            ids = prompt["prompt_token_ids"]
            if not _is_token_ids(ids):
                raise TypeError(
                    f"{name}['prompt_token_ids'] must be a list of token ids (ints), got {reprlib.repr(ids)}"
                )
            return list(ids)
        if "prompt" in prompt:
            return prompt["prompt"]
    elif isinstance(prompt, str):
        return prompt
    elif _is_token_ids(prompt):
        return list(prompt)
    raise TypeError(
        f"{name} must be a string, a list of token ids (ints), or a dict with 'prompt' or "
        f"'prompt_token_ids', got {reprlib.repr(prompt)}"
    )


# The name this module's outputs had before they took vLLM's.
GenerationOutput = RequestOutput


class _TextStream:
    """The text of a request with stop strings, as it is generated."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        self.processor = OutputProcessor(tokenizer, params, prompt_token_ids)
        self.text: list[str] = []

    def add(self, out: EngineOutput) -> bool:
        """Whether a stop string ended the request."""
        delta = self.processor.add(out.new_token_ids, out.finished, out.finish_reason)
        self.text.append(delta.text)
        return delta.stopped
