"""tandem's own request errors: a code a user can act on and a message naming the limit.

The request layer and the engine raise and pass these; only a transport maps the code to its own
(the gRPC servicer to a status code of the same name, an HTTP front end to a status)."""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"  # can never succeed as sent
    RESOURCE_EXHAUSTED = "resource_exhausted"  # a queue or size limit: retry later, or smaller
    UNAVAILABLE = "unavailable"  # no executor, or shutting down: retry elsewhere
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CANCELLED = "cancelled"
    INTERNAL = "internal"  # a step failed


class TandemRequestError(Exception):
    """A request that failed, with the code its transport reports it under."""

    code = ErrorCode.INTERNAL

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __repr__(self) -> str:
        return f"TandemRequestError({self.message!r}, {self.code})"


class InvalidRequestError(TandemRequestError, ValueError):
    """A request that can never succeed (INVALID_ARGUMENT)."""

    code = ErrorCode.INVALID_ARGUMENT


class QueueFullError(TandemRequestError):
    """More requests (or prompt tokens) are waiting than --max-queue (--max-queued-tokens) allows."""

    code = ErrorCode.RESOURCE_EXHAUSTED
