"""The model's tokenizer, loaded from `tokenizer.json` with the `tokenizers` library (no torch)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

# How many times fewer UTF-8 bytes a normalizer's output can have than its input: NFC composes
# three Hangul jamo (9 bytes) into one syllable (3), NFKC maps a 4-byte mathematical letter to
# ASCII, lowercasing the Kelvin sign (3 bytes) gives "k". Other normalizers (Strip, Replace, ...)
# can remove any amount of text: no bound.
_NORMALIZER_SHRINK = {"NFC": 3, "NFD": 3, "NFKC": 4, "NFKD": 4, "Lowercase": 3}


class Tokenizer:
    def __init__(self, path: str | Path):
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.exists():
            raise FileNotFoundError(f"no tokenizer.json in {path}; pass --tokenizer or token ids")
        self._tok = _HFTokenizer.from_file(str(file))
        # The most bytes of text one token stands for (None: no sound bound for this tokenizer).
        self.max_bytes_per_token = _max_bytes_per_token(json.loads(self._tok.to_str()))

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

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

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
    longest = max(len(token) for token in model["vocab"])
    added = max((len(t["content"].encode()) for t in spec.get("added_tokens") or ()), default=0)
    return max(longest, added) * shrink


def _is_byte_level(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_is_byte_level(p) for p in pre_tokenizer.get("pretokenizers", ()))
    return pre_tokenizer.get("type") == "ByteLevel"


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
