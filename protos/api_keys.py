"""Shared secrets on a gRPC call, the same on both services: the keys a server accepts (a key, or a
file of keys, one a line) and the check of `authorization: Bearer <key>` in constant time.

The scheduler asks them of its clients (scheduler_service/security.py), the executor of its
scheduler (executor_service/security.py)."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc

AUTHORIZATION = "authorization"
_BEARER = "bearer "


def load_api_keys(key: str | None = None, key_file: str | Path | None = None) -> list[str]:
    """The accepted keys: `key`, and every non-empty line of `key_file` that is no `#` comment
    (several keys let one be rotated without downtime). Raises ValueError for an unreadable or
    empty file."""
    keys = [key.strip()] if key and key.strip() else []
    if key_file:
        try:
            lines = Path(key_file).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"cannot read the API key file {key_file}: {e.strerror}") from None
        from_file = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not from_file:
            raise ValueError(f"the API key file {key_file} holds no key")
        keys += from_file
    return keys


def bearer_metadata(key: str) -> tuple[str, str]:
    return (AUTHORIZATION, f"Bearer {key}")


class ApiKeys:
    """Whether a call's metadata carries `authorization: Bearer <key>` naming one of `keys`."""

    def __init__(self, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError("ApiKeys needs at least one key")
        self._keys = [k.encode() for k in keys]

    def authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        token = b""
        for name, value in metadata or ():
            if name == AUTHORIZATION:
                text = value.decode("latin-1") if isinstance(value, bytes) else value
                if text[: len(_BEARER)].lower() == _BEARER:
                    token = text[len(_BEARER) :].strip().encode("utf-8", "surrogateescape")
                break
        # Every key is compared (constant time each), whichever matches.
        matches = [hmac.compare_digest(token, key) for key in self._keys]
        return bool(token) and any(matches)


def refusing_handler(handler: grpc.RpcMethodHandler, refuse: Callable) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` whose behaviour is `refuse(request, context)`
    (which aborts). No request deserializer: a refused request's bytes are never parsed."""
    kwargs = {"response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    return grpc.stream_stream_rpc_method_handler(refuse, **kwargs)
