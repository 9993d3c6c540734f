"""Who may call the scheduler: API keys (bearer tokens, compared in constant time) and TLS.

Health checks stay open so that load balancers and grpc-health-probe need no key.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2

from client.client import read_pem

logger = logging.getLogger(__name__)

OPEN_SERVICES = (health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,)
_BEARER = "bearer "


def load_api_keys(key: str | None = None, key_file: str | Path | None = None) -> list[str]:
    """The accepted keys: `key`, and every non-empty line of `key_file` (several keys let one be
    rotated without downtime). Raises ValueError for an unreadable or empty file."""
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


def server_credentials(cert: str | Path | bytes, key: str | Path | bytes) -> grpc.ServerCredentials:
    """TLS for the client-facing port: this server's certificate chain and private key (PEM)."""
    return grpc.ssl_server_credentials([(read_pem(key), read_pem(cert))])


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for any call outside OPEN_SERVICES without `authorization: Bearer <key>`
    naming one of the keys."""

    def __init__(self, keys: Sequence[str], on_refused: Callable[[], None] = lambda: None) -> None:
        if not keys:
            raise ValueError("ApiKeyInterceptor needs at least one key")
        self._keys = [k.encode() for k in keys]
        self._on_refused = on_refused

    def _authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        token = b""
        for name, value in metadata or ():
            if name == "authorization":
                text = value.decode("latin-1") if isinstance(value, bytes) else value
                if text[: len(_BEARER)].lower() == _BEARER:
                    token = text[len(_BEARER) :].strip().encode("utf-8", "surrogateescape")
                break
        # Every key is compared (constant time each), whichever matches.
        matches = [hmac.compare_digest(token, key) for key in self._keys]
        return bool(token) and any(matches)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        service = details.method.lstrip("/").split("/", 1)[0]
        if service in OPEN_SERVICES or self._authorized(details.invocation_metadata):
            return await continuation(details)
        handler = await continuation(details)
        self._on_refused()
        if handler is None:
            return None
        return _refusing(handler)


async def _refuse(request: object, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED,
        "missing or invalid API key: send the header 'authorization: Bearer <key>'",
    )


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind that aborts UNAUTHENTICATED without reading the request."""
    # No request deserializer: the refused request's bytes are never parsed.
    kwargs = {"response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_refuse, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_refuse, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_refuse, **kwargs)
    return grpc.stream_stream_rpc_method_handler(_refuse, **kwargs)
