"""Who may call the executor: (mutual) TLS server credentials from PEM files or bytes."""

from __future__ import annotations

from pathlib import Path

import grpc


def _read_pem(source: str | Path | bytes, what: str) -> bytes:
    if isinstance(source, bytes):
        return source
    try:
        return Path(source).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {source}: {e.strerror}") from None


def server_credentials(
    cert: str | Path | bytes, key: str | Path | bytes, ca: str | Path | bytes | None = None
) -> grpc.ServerCredentials:
    """TLS with this executor's certificate chain and private key (PEM, bytes or file paths).
    With `ca`, mutual TLS: only clients presenting a certificate signed by that CA (the
    scheduler) complete the handshake; every service, health included, sits behind it."""
    pair = (_read_pem(key, "TLS key"), _read_pem(cert, "TLS certificate"))
    if ca is None:
        return grpc.ssl_server_credentials([pair])
    return grpc.ssl_server_credentials(
        [pair], root_certificates=_read_pem(ca, "TLS CA"), require_client_auth=True
    )
