"""Who may call the executor: (mutual) TLS server credentials from PEM files or bytes."""

from __future__ import annotations

from pathlib import Path

import grpc

from client.client import read_pem


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
