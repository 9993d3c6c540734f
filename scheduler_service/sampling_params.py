"""Client-facing sampling parameters and request validation."""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from protos.defaults import INT32_MAX
from protos.plan import StepSamplingParams
from scheduler_service.errors import InvalidRequestError

__all__ = [
    "InvalidRequestError",
    "SamplingParams",
    "truncate_prompt",
    "verify_prompt_length",
    "verify_request",
    "verify_token_ids",
]

# Limits that keep one request's stop-string matching cheap (the detokenizer checks every stop
# string at every token).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
# More than any use needs (a vocabulary's special tokens): each id is checked on the event loop, and
# a 16 MiB gRPC message holds 15M of them (9 s of the loop, health checks included).
MAX_STOP_TOKEN_IDS = 4096
# OpenAI's range for presence_penalty and frequency_penalty.
MAX_ABS_PENALTY = 2.0
# OpenAI's limits on logit_bias: 300 entries, each bias in [-100, 100].
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_ABS_LOGIT_BIAS = 100.0
# Samples of one request (n), as the HTTP API has always allowed.
MAX_N = 128
# The executor's step plan carries the sampling parameters as 32-bit floats and integers, and the seed
# in 64 bits (executor.proto): a seed in [-2**63, 2**64) travels modulo 2**64 (a negative one is
# vLLM's int64 seed; -1, as in vLLM, is no seed: __post_init__), a top_k past the vocabulary is off.
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
# vLLM's _MAX_TEMP: a temperature in (0, this) samples at this one (vLLM's SamplingParams raises it,
# with a warning), not more sharply, and not greedily either (only 0 is greedy then).
MIN_SAMPLING_TEMPERATURE = 1e-2
_INT_FIELDS = (
    "max_tokens",
    "top_k",
    "seed",
    "logprobs",
    "n",
    "min_tokens",
    "prompt_logprobs",
    "truncate_prompt_tokens",
)
# (a string "false" would pass as true)
_BOOL_FIELDS = ("skip_special_tokens", "spaces_between_special_tokens", "detokenize")
# Those that may be None.
_OPTIONAL_INT_FIELDS = ("max_tokens", "seed", "logprobs", "prompt_logprobs", "truncate_prompt_tokens")
_FLOAT_FIELDS = (
    "temperature",
    "min_p",
    "top_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    # Greedy by default (vLLM's default is 1.0; the HTTP API passes 1.0, as vLLM's).
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = field(default_factory=list)
    stop_token_ids: list[int] | None = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Top alternatives per sampled token, beside its own logprob (0: the sampled token's own only, as
    # vLLM's); None (vLLM's default): none.
    logprobs: int | None = None
    # Samples generated from the prompt (front ends run them as n requests: for_samples()).
    n: int = 1
    # Stop tokens (end-of-sequence and stop_token_ids) and stop strings wait for this many tokens.
    min_tokens: int = 0
    # OpenAI's logit_bias: token id -> bias added to its logit before sampling.
    logit_bias: dict[int, float] | None = field(default_factory=dict)
    # Top alternatives per prompt token with the prompt's logprobs (0: each token's own); None: none.
    prompt_logprobs: int | None = None
    # Keep the stop string, or the stop token's text, at the end of the output (vLLM's option).
    include_stop_str_in_output: bool = False
    # Leave special tokens (end-of-sequence, <|im_end|>, ...) out of the text; off, the text writes
    # them as the tokenizer's decode(ids, skip_special_tokens=False) does. Logprobs name every token
    # by its own text either way.
    skip_special_tokens: bool = True
    # vLLM's option for its slow (Python) tokenizers, whose decode puts a space on each side of a
    # special token when it is on. The `tokenizers` decoder this server uses (as vLLM's fast
    # tokenizers) adds no spaces whatever its value: both are taken, and the text is the same.
    spaces_between_special_tokens: bool = True
    # vLLM's: off, the offline LLM leaves its outputs undecoded (text "", logprobs without their
    # tokens' text; the token ids as ever), and stop strings, which match the text, are refused. The
    # servers always decode.
    detokenize: bool = True
    # Keep only the prompt's last k tokens (left truncation); -1: max_model_len; None: the whole prompt.
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        # -1 is vLLM's "off", the same as 0.
        if self.top_k == -1:
            self.top_k = 0
        # vLLM's: a temperature in (0, 0.01) samples at 0.01.
        self.temperature = _sampling_temperature(self.temperature)
        # vLLM's: seed -1 is no seed (a random one per request), not a fixed seed.
        if self.seed == -1 and not isinstance(self.seed, bool):
            self.seed = None
        # vLLM's stop may be one string (not a list of its characters) or None, as OpenAI's is.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.logit_bias is None:  # vLLM's default
            self.logit_bias = {}
        self.verify()

    def verify(self) -> None:
        """Raise InvalidRequestError naming the violated limit."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_INT_FIELDS:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                _fail(f"{name} must be an integer, got {value!r}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                _fail(f"{name} must be a number, got {value!r}")
            if not math.isfinite(_float32(value)):
                _fail(
                    f"{name} must be a finite number (a 32-bit float: at most 3.4e38 in magnitude), "
                    f"got {getattr(self, name)}"
                )
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                _fail(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if not isinstance(self.stop, (list, tuple)):
            _fail(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            _fail(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        if not isinstance(self.logit_bias, dict):
            _fail(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            _fail(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for i, stop in enumerate(self.stop):
            if not isinstance(stop, str):
                _fail(f"stop[{i}] must be a string, got {stop!r}")
            if not stop:
                _fail(f"stop[{i}] is an empty string: a stop string needs at least one character")
            if len(stop) > MAX_STOP_STRING_CHARS:
                _fail(f"stop[{i}] is {len(stop)} characters long; at most {MAX_STOP_STRING_CHARS}")
            verify_unicode(stop, f"stop[{i}]")
        if self.stop and not self.detokenize:
            _fail("stop strings match the output's text: they need detokenize=True")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            _fail(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}")
        if self.max_tokens is not None and self.max_tokens < 1:
            _fail(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            _fail(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < _float32(self.top_p) <= 1:  # as the plan carries it: 1e-46 is 0 there
            underflow = " (0 as a 32-bit float)" if 0 < self.top_p <= 1 else ""
            _fail(f"top_p must be in (0, 1], got {self.top_p}{underflow}")
        if self.top_k < -1:  # (-1 too where it was set after construction)
            _fail(f"top_k must be >= 0 (0 or -1 disables it), got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if abs(getattr(self, name)) > MAX_ABS_PENALTY:
                _fail(
                    f"{name} must be in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}], got {getattr(self, name)}"
                )
        if not 0 <= self.min_p <= 1:
            _fail(f"min_p must be in [0, 1], got {self.min_p}")
        if _float32(self.repetition_penalty) <= 0:
            underflow = " (0 as a 32-bit float)" if self.repetition_penalty > 0 else ""
            _fail(f"repetition_penalty must be > 0, got {self.repetition_penalty}{underflow}")
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            _fail(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if self.logprobs is not None and self.logprobs < 0:
            _fail(f"logprobs must be >= 0, got {self.logprobs}")
        for i, t in enumerate(self.stop_token_ids):
            if isinstance(t, bool) or not isinstance(t, int):
                _fail(f"stop_token_ids[{i}] must be an integer, got {t!r}")
            if t < 0:
                _fail(f"stop_token_ids[{i}] must be >= 0, got {t}")
        if not 1 <= self.n <= MAX_N:
            _fail(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.min_tokens < 0:
            _fail(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            _fail(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if self.truncate_prompt_tokens is not None and not (
            self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1
        ):
            _fail(
                "truncate_prompt_tokens must be >= 1 (keep the prompt's last N tokens) or -1 "
                f"(max_model_len), got {self.truncate_prompt_tokens}"
            )
        self._verify_logit_bias()

    def _verify_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            _fail(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}")
        for token_id, bias in self.logit_bias.items():
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                _fail(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
            number = isinstance(bias, (int, float)) and not isinstance(bias, bool)
            if not (number and math.isfinite(bias) and abs(bias) <= MAX_ABS_LOGIT_BIAS):
                _fail(
                    f"logit_bias[{token_id}] must be in [-{MAX_ABS_LOGIT_BIAS:g}, "
                    f"{MAX_ABS_LOGIT_BIAS:g}], got {bias}"
                )

    def for_samples(self) -> list[SamplingParams]:
        """The n samples as n requests of n = 1 each, sharing the prompt through the prefix cache;
        a seeded request's samples take seeds seed, seed + 1, ... (so they differ); the first
        sample alone scores the prompt (prompt_logprobs)."""
        if self.n == 1:
            return [self]
        return [
            dataclasses.replace(
                self,
                n=1,
                seed=None if self.seed is None else (self.seed + j) % 2**64,
                prompt_logprobs=self.prompt_logprobs if j == 0 else None,
            )
            for j in range(self.n)
        ]

    def summary(self) -> str:
        """The fields set away from their defaults, briefly (for a log line)."""
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            if value == default:
                continue
            if f.name in ("stop", "stop_token_ids", "logit_bias"):
                value = f"{len(value)} entries"
            parts.append(f"{f.name}={value}")
        return ", ".join(parts) or "default sampling"

    def to_step_params(self, num_prompt_tokens: int) -> StepSamplingParams:
        return StepSamplingParams(
            temperature=_sampling_temperature(self.temperature),  # (also where set after construction)
            top_k=min(max(self.top_k, 0), INT32_MAX),
            top_p=self.top_p,
            min_p=self.min_p,
            seed=None if self.seed is None else self.seed % 2**64,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            # The executor reports a sampled token's logprob beside at least one alternative (0:
            # none): logprobs 0 asks it for one, which Sequence.append_logprobs leaves out.
            logprobs=0 if self.logprobs is None else max(self.logprobs, 1),
            num_prompt_tokens=num_prompt_tokens,
            min_tokens=self.min_tokens,
            logit_bias_token_ids=list(self.logit_bias),
            logit_bias_values=[float(v) for v in self.logit_bias.values()],
            prompt_logprobs=self.prompt_logprobs,
        )


def verify_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    max_logprobs: int | None = None,
) -> None:
    """Checks that need the executor's limits (and the scheduler's `max_logprobs`, None: none);
    raise InvalidRequestError."""
    if len(prompt_token_ids) == 0:
        _fail("prompt is empty: at least one token is required")
    # (the length first: a prompt of millions of ids is refused without a pass over them)
    verify_prompt_length(len(prompt_token_ids), params, max_model_len)
    verify_token_ids(prompt_token_ids, vocab_size)
    if (params.logprobs or 0) > vocab_size:
        _fail(f"logprobs ({params.logprobs}) exceeds the vocabulary size ({vocab_size})")
    if max_logprobs is not None and (params.logprobs or 0) > max_logprobs:
        _fail(
            f"logprobs ({params.logprobs}) exceeds max_logprobs ({max_logprobs}; the scheduler's --max-logprobs)"
        )
    for i, t in enumerate(params.stop_token_ids):
        if t >= vocab_size:
            _fail(f"stop_token_ids[{i}] = {t} is outside the vocabulary (size {vocab_size})")
    for t in params.logit_bias:
        if t >= vocab_size:
            _fail(f"logit_bias token id {t} is outside the vocabulary (size {vocab_size})")
    if params.prompt_logprobs is not None:
        if params.prompt_logprobs > vocab_size:
            _fail(f"prompt_logprobs ({params.prompt_logprobs}) exceeds the vocabulary size ({vocab_size})")
        if max_logprobs is not None and params.prompt_logprobs > max_logprobs:
            _fail(
                f"prompt_logprobs ({params.prompt_logprobs}) exceeds max_logprobs ({max_logprobs}; the "
                "scheduler's --max-logprobs)"
            )


def truncated_length(params: SamplingParams, max_model_len: int) -> int | None:
    """How many of a prompt's last tokens truncate_prompt_tokens keeps (None: all of them)."""
    k = params.truncate_prompt_tokens
    return max_model_len if k == -1 else k


def truncate_prompt(token_ids: Sequence[int], params: SamplingParams, max_model_len: int) -> Sequence[int]:
    """The prompt's last truncate_prompt_tokens tokens (vLLM's left truncation: the end of a prompt,
    nearest what is generated, is what the model needs most); all of them (`token_ids` itself) when
    it is None or the prompt is no longer."""
    k = truncated_length(params, max_model_len)
    return token_ids[-k:] if k is not None and len(token_ids) > k else token_ids


def verify_token_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    """Raise InvalidRequestError for an id outside [0, vocab_size): the model's vocabulary, which is
    what the executor embeds and samples from (a tokenizer may know fewer ids, or more)."""
    for i, t in enumerate(token_ids):
        if not 0 <= t < vocab_size:
            _fail(f"token id {t} at position {i} is outside the vocabulary (size {vocab_size})")


def verify_prompt_length(
    num_tokens: int, params: SamplingParams, max_model_len: int, *, lower_bound: bool = False
) -> None:
    """Raise InvalidRequestError when a prompt of `num_tokens` leaves no room to generate;
    `lower_bound`: the prompt has at least that many (counted from a text's size, before it is
    tokenized)."""
    n = f"{num_tokens} token{'s' if num_tokens != 1 else ''}"
    if lower_bound:
        n = f"at least {n}, from its size"
    if params.max_tokens is None:
        if num_tokens >= max_model_len:
            _fail(f"prompt ({n}) leaves no room to generate within max_model_len ({max_model_len})")
        if num_tokens + params.min_tokens > max_model_len:
            _fail(f"prompt ({n}) + min_tokens ({params.min_tokens}) exceeds max_model_len ({max_model_len})")
    elif num_tokens + params.max_tokens > max_model_len:
        _fail(f"prompt ({n}) + max_tokens ({params.max_tokens}) exceeds max_model_len ({max_model_len})")


def verify_unicode(text: str, name: str) -> None:
    """Raise InvalidRequestError for a text that is not Unicode: a lone surrogate (JSON can escape
    one), which no tokenizer, UTF-8 or msgpack takes."""
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError as e:
            _fail(f"{name} is not valid Unicode ({e.reason}) at character {e.start}")


def escape_surrogates(text: str) -> str:
    """text with any lone surrogate written as its escape ("\\ud800"): UTF-8, and so an HTTP body,
    a gRPC message or msgpack, cannot carry one (verify_unicode refuses it where it is input)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _float32(x: float) -> float:
    """x as the step plan carries it: rounded to a 32-bit float (infinite past its range)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _sampling_temperature(temperature: float) -> float:
    """The temperature a request samples at, as vLLM's SamplingParams sets it: one in
    (0, MIN_SAMPLING_TEMPERATURE) is raised to MIN_SAMPLING_TEMPERATURE (anything else, a value
    verify refuses included, is left as it is)."""
    number = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
    if number and 0 < temperature < MIN_SAMPLING_TEMPERATURE:
        return MIN_SAMPLING_TEMPERATURE
    return temperature


def _fail(message: str) -> None:
    raise InvalidRequestError(message)
