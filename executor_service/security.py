"""Who may call the executor: (mutual) TLS server credentials from PEM files or bytes, and a shared
secret (an API key, checked as the scheduler's own keys are: protos/api_keys.py) that its
scheduler sends. Health and reflection need no key; mutual TLS guards them too."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from protos.api_keys import ApiKeys, refusing_handler
from protos.defaults import read_pem

OPEN_SERVICES = (health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)


def server_credentials(
    cert: str | Path | bytes, key: str | Path | bytes, ca: str | Path | bytes | None = None
) -> grpc.ServerCredentials:
    """TLS with this executor's certificate chain and private key (PEM, bytes or file paths).
    With `ca`, mutual TLS: only clients presenting a certificate signed by that CA (the
    scheduler) complete the handshake; every service, health included, sits behind it."""
    pair = (read_pem(key, "the TLS key"), read_pem(cert, "the TLS certificate"))
    if ca is None:
        return grpc.ssl_server_credentials([pair])
    return grpc.ssl_server_credentials(
        [pair], root_certificates=read_pem(ca, "the TLS CA"), require_client_auth=True
    )


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """UNAUTHENTICATED for any call outside OPEN_SERVICES without `authorization: Bearer <key>`
    naming one of the keys (the scheduler's --executor-api-key)."""

    def __init__(self, keys: Sequence[str], on_refused: Callable[[str], None] = lambda method: None) -> None:
        self._keys = ApiKeys(keys)
        self._on_refused = on_refused

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        service = details.method.lstrip("/").split("/", 1)[0]
        if service in OPEN_SERVICES or self._keys.authorized(details.invocation_metadata):
            return continuation(details)
        handler = continuation(details)
        self._on_refused(details.method)
        if handler is None:
            return None
        return refusing_handler(handler, _refuse)


def _refuse(request: object, context: grpc.ServicerContext) -> None:
    context.abort(
        grpc.StatusCode.UNAUTHENTICATED,
        "missing or invalid executor API key: the scheduler sends it with --executor-api-key or "
        "--executor-api-key-file (header 'authorization: Bearer <key>')",
    )
