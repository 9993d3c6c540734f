"""Who may call the scheduler: API keys (bearer tokens, compared in constant time; protos/api_keys.py)
and TLS.

Health checks stay open so that load balancers and grpc-health-probe need no key.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2

from protos.api_keys import ApiKeys, load_api_keys, refusing_handler
from protos.defaults import read_pem

__all__ = ["OPEN_SERVICES", "ApiKeyInterceptor", "load_api_keys", "server_credentials"]

logger = logging.getLogger(__name__)

OPEN_SERVICES = (health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,)


def server_credentials(cert: str | Path | bytes, key: str | Path | bytes) -> grpc.ServerCredentials:
    """TLS for the client-facing port: this server's certificate chain and private key (PEM)."""
    return grpc.ssl_server_credentials([(read_pem(key), read_pem(cert))])


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for any call outside OPEN_SERVICES without `authorization: Bearer <key>`
    naming one of the keys."""

    def __init__(self, keys: Sequence[str], on_refused: Callable[[], None] = lambda: None) -> None:
        self._keys = ApiKeys(keys)
        self._on_refused = on_refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        service = details.method.lstrip("/").split("/", 1)[0]
        if service in OPEN_SERVICES or self._keys.authorized(details.invocation_metadata):
            return await continuation(details)
        handler = await continuation(details)
        self._on_refused()
        if handler is None:
            return None
        return refusing_handler(handler, _refuse)


async def _refuse(request: object, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED,
        "missing or invalid API key: send the header 'authorization: Bearer <key>'",
    )
