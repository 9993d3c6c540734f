"""A stream's pending tokens as GenerateChunk messages, each under the message limit: a reader
that pauses lets tokens (and their logprobs) pile up, and one message of them all failed the
stream beyond 16 MiB (RESOURCE_EXHAUSTED after 155 of 1,000 tokens at 4,096 logprobs)."""

from __future__ import annotations

from collections.abc import Iterator

from protos.tandem.v1 import generation_pb2 as pb
from scheduler_service.sequence import TokenLogprob
from scheduler_service.tokenizer import Tokenizer

# A token id in the packed column: at most a 5-byte varint.
_ID_BYTES = 5


def logprobs_to_proto(
    logprobs: list[TokenLogprob], tokenizer: Tokenizer | None = None
) -> list[pb.TokenLogprob]:
    """With a tokenizer, each token named by its text."""
    text = tokenizer.token_text if tokenizer is not None else lambda token_id: ""
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top_logprobs=[pb.Logprob(token_id=t, logprob=v, token=text(t)) for t, v in lp.top_logprobs],
            token=text(lp.token_id),
            rank=lp.rank or 0,
        )
        for lp in logprobs
    ]


def split_logprobs(logprobs: list[pb.TokenLogprob], max_bytes: int) -> Iterator[list[pb.TokenLogprob]]:
    """Consecutive slices of logprobs of at most max_bytes each (prompt logprobs, sent alone)."""
    start, size = 0, 0
    for i, lp in enumerate(logprobs):
        entry = lp.ByteSize() + 5
        if i > start and size + entry > max_bytes:
            yield logprobs[start:i]
            start, size = i, 0
        size += entry
    if start < len(logprobs):
        yield logprobs[start:]


def split_tokens(
    ids: list[int], logprobs: list[pb.TokenLogprob], max_bytes: int
) -> Iterator[tuple[list[int], list[pb.TokenLogprob]]]:
    """Consecutive (ids, logprobs) slices whose encoded ids and logprobs take at most max_bytes
    each (a token bigger than that alone goes on its own); one empty slice for no tokens."""
    start, size = 0, 0
    for i in range(len(ids)):
        # + the field's tag and length prefix (at most 4 bytes below 16 MiB)
        token = _ID_BYTES + (logprobs[i].ByteSize() + 5 if logprobs else 0)
        if i > start and size + token > max_bytes:
            yield ids[start:i], logprobs[start:i]
            start, size = i, 0
        size += token
    if start < len(ids) or not ids:
        yield ids[start:], logprobs[start:]


def split_text(text: str, max_chars: int) -> list[str]:
    """`text` in pieces of at most max_chars characters (at least one piece)."""
    return [text[i : i + max_chars] for i in range(0, len(text), max_chars)] or [""]
