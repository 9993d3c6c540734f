"""The model's tokenizer, loaded from `tokenizer.json` with the `tokenizers` library (no torch)."""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

from protos.defaults import DEFAULT_MODEL
from protos.plan import ExecutorInfo
from scheduler_service.chat_template import ChatTemplate

# How many times fewer UTF-8 bytes a normalizer's output can have than its input: NFC composes
# three Hangul jamo (9 bytes) into one syllable (3), NFKC maps a 4-byte mathematical letter to
# ASCII, lowercasing the Kelvin sign (3 bytes) gives "k"; Prepend only adds text. Other
# normalizers (Strip, Replace, ...) can remove any amount of text: no bound.
_NORMALIZER_SHRINK = {"NFC": 3, "NFD": 3, "NFKC": 4, "NFKD": 4, "Lowercase": 3, "Prepend": 1}
# Pre-tokenizers that keep every byte of their input (Split keeps its matches unless "Removed").
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Digits", "Punctuation"}


logger = logging.getLogger(__name__)


class Tokenizer:
    def __init__(self, path: str | Path):
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.exists():
            raise FileNotFoundError(f"no tokenizer.json in {path}; pass --tokenizer or token ids")
        try:
            self._tok = _HFTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot read
            raise ValueError(f"cannot load the tokenizer {file}: {e}") from None
        # The checkpoint directory (its chat template lies beside tokenizer.json).
        self.path = file.parent
        # The most bytes of text one token stands for (None: no sound bound for this tokenizer).
        self.max_bytes_per_token = _max_bytes_per_token(json.loads(self._tok.to_str()))
        self._token_texts: dict[int, str] = {}

    @functools.cached_property
    def chat_template(self) -> ChatTemplate | None:
        """The checkpoint's chat template (chat_template.jinja or tokenizer_config.json), if any."""
        return ChatTemplate.load(self.path)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), without tokenizing: so that a text that cannot fit
        is refused before the work (tokenizing 16 MiB took 15 s and 2 GB). 0 when unknown."""
        if self.max_bytes_per_token is None:
            return 0
        num_bytes = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        return math.ceil(num_bytes / self.max_bytes_per_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`add_special_tokens`: off for a rendered chat template, which writes its own (as
        transformers' apply_chat_template)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_off_gil(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """encode(text), releasing Python's GIL while the Rust tokenizer runs (`encode` holds it:
        a thread tokenizing 3 MiB stalled every other thread for 1.6 s), for long texts tokenized
        in a thread beside the event loop."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included (logprobs name their tokens by it)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return text

    def decode_stream(self, skip_special_tokens: bool = True) -> Callable[[int], str | None]:
        """An incremental decoder of one token stream (tokenizers' DecodeStream, special tokens
        skipped unless `skip_special_tokens` is off): each call takes the next id and returns the
        new text, or None while the text ends inside a character."""
        return functools.partial(DecodeStream(skip_special_tokens=skip_special_tokens).step, self._tok)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's own string for an id (byte-level BPE's "Ġworld" for " world"), as
        transformers' convert_ids_to_tokens names it; None for an id the vocabulary lacks."""
        return self._tok.id_to_token(token_id)

    @staticmethod
    def exists(path: str | Path) -> bool:
        path = Path(path)
        return (path / "tokenizer.json").exists() if path.is_dir() else path.exists()


def _max_bytes_per_token(spec: dict) -> int | None:
    """For byte-level BPE (the Qwen3 family's): the longest vocabulary entry, whose characters
    are one byte each, or the longest added token, times what the normalizer can shrink."""
    model, pre_tokenizer = spec.get("model") or {}, spec.get("pre_tokenizer")
    if model.get("type") != "BPE" or not _is_byte_level(pre_tokenizer) or spec.get("truncation"):
        return None
    shrink = _shrink(spec.get("normalizer"))
    if shrink is None or not model.get("vocab"):
        return None
    added_tokens = spec.get("added_tokens") or ()
    if model.get("fuse_unk") or any(t.get("lstrip") or t.get("rstrip") for t in added_tokens):
        return None  # one token can swallow any run of unknown characters or of whitespace
    longest = max(len(token) for token in model["vocab"])
    added = max((len(t["content"].encode()) for t in added_tokens), default=0)
    return max(longest, added) * shrink


def _is_byte_level(pre_tokenizer: dict | None) -> bool:
    """A ByteLevel pre-tokenizer, alone or in a Sequence of steps that each keep all their input."""
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        steps = pre_tokenizer.get("pretokenizers", ())
        return any(p.get("type") == "ByteLevel" for p in steps) and all(_keeps_input(p) for p in steps)
    return pre_tokenizer.get("type") == "ByteLevel"


def _keeps_input(pre_tokenizer: dict) -> bool:
    if pre_tokenizer.get("type") == "Split":
        return pre_tokenizer.get("behavior") != "Removed"
    return pre_tokenizer.get("type") in _KEEPING_PRE_TOKENIZERS


def _shrink(normalizer: dict | None) -> int | None:
    if normalizer is None:
        return 1
    if normalizer.get("type") == "Sequence":
        product = 1
        for n in normalizer.get("normalizers", ()):
            factor = _shrink(n)
            if factor is None:
                return None
            product *= factor
        return product
    return _NORMALIZER_SHRINK.get(normalizer.get("type"))


def tokenizer_resolver(explicit: Tokenizer | None) -> Callable[[ExecutorInfo], Tokenizer | None]:
    """--tokenizer if given, else the embedded model's when the executor serves that model."""

    def resolve(info: ExecutorInfo) -> Tokenizer | None:
        if explicit is not None:
            return explicit
        if info.model == DEFAULT_MODEL.name and Tokenizer.exists(DEFAULT_MODEL):
            return Tokenizer(DEFAULT_MODEL)
        logger.warning(
            "no tokenizer for model %r: text prompts are refused and responses carry token ids only "
            "(start with --tokenizer DIR)",
            info.model,
        )
        return None

    return resolve
