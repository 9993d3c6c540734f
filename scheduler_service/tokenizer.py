"""The model's tokenizer, loaded from `tokenizer.json` with the `tokenizers` library (no torch)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, path: str | Path):
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.exists():
            raise FileNotFoundError(f"no tokenizer.json in {path}; pass --tokenizer or token ids")
        self._tok = _HFTokenizer.from_file(str(file))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

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
