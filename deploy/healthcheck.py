#!/usr/bin/env python3
"""Container health probe: exit 0 when the service answers SERVING on grpc.health.v1, else 1.

    tandem-healthcheck scheduler             # 127.0.0.1:$TANDEM_SCHEDULER_PORT (default 50051)
    tandem-healthcheck executor              # 127.0.0.1:$TANDEM_EXECUTOR_PORT (default 50052)
    tandem-healthcheck --address HOST:PORT

TLS follows the service's own settings, read from the same environment its CLI reads: when the
service serves TLS (TANDEM_TLS_CERT for the scheduler, TANDEM_EXECUTOR_SERVER_TLS_CERT for the
executor) the probe connects over TLS, trusting --tls-ca (TANDEM_HEALTHCHECK_TLS_CA), else the
executor's client CA (TANDEM_EXECUTOR_SERVER_TLS_CA, where one CA signs both sides), else the
service's certificate file (a self-signed certificate, or a chain that ends at its CA). An
executor with mutual TLS needs a client certificate: --tls-cert / --tls-key
(TANDEM_HEALTHCHECK_TLS_CERT / _KEY). --tls-server-name (TANDEM_HEALTHCHECK_TLS_SERVER_NAME) is the
name to expect when the certificate does not name 127.0.0.1.

Docker's HEALTHCHECK and compose's `healthcheck` run it inside the container; Kubernetes uses
its native `grpc:` probes on the same health service instead (plaintext only).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# The port each service listens on, as its CLI reads it: (environment variable, default).
PORTS = {"scheduler": ("TANDEM_SCHEDULER_PORT", 50051), "executor": ("TANDEM_EXECUTOR_PORT", 50052)}
# The variables that turn on each service's TLS: (its certificate, the CA of its clients).
TLS = {
    "scheduler": ("TANDEM_TLS_CERT", None),
    "executor": ("TANDEM_EXECUTOR_SERVER_TLS_CERT", "TANDEM_EXECUTOR_SERVER_TLS_CA"),
}


def _env(name: str | None) -> str | None:
    return os.environ.get(name) or None if name else None


def credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """None for plaintext; else TLS credentials as the module docstring says."""
    cert_var, client_ca_var = TLS[args.service]
    server_cert = _env(cert_var)
    if not (args.tls or args.tls_ca or server_cert):
        return None
    root = args.tls_ca or _env(client_ca_var) or server_cert
    pem = {
        name: Path(path).read_bytes() if path else None
        for name, path in (("root", root), ("cert", args.tls_cert), ("key", args.tls_key))
    }
    if (pem["cert"] is None) != (pem["key"] is None):
        raise ValueError("--tls-cert and --tls-key go together: give both or neither")
    return grpc.ssl_channel_credentials(
        root_certificates=pem["root"], private_key=pem["key"], certificate_chain=pem["cert"]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Exit 0 if the service reports SERVING on grpc.health.v1.")
    p.add_argument("service", nargs="?", choices=sorted(PORTS), default="scheduler")
    p.add_argument("--address", default=None, help="HOST:PORT (default: 127.0.0.1 and the service's port)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    p.add_argument(
        "--tls", action="store_true", help="connect over TLS even where the environment does not say so"
    )
    p.add_argument("--tls-ca", default=_env("TANDEM_HEALTHCHECK_TLS_CA"), help="CA to trust, PEM")
    p.add_argument("--tls-cert", default=_env("TANDEM_HEALTHCHECK_TLS_CERT"), help="client certificate, PEM")
    p.add_argument("--tls-key", default=_env("TANDEM_HEALTHCHECK_TLS_KEY"), help="its private key, PEM")
    p.add_argument(
        "--tls-server-name",
        default=_env("TANDEM_HEALTHCHECK_TLS_SERVER_NAME"),
        help="name the certificate must carry",
    )
    args = p.parse_args(argv)
    env_name, default_port = PORTS[args.service]
    address = args.address or f"127.0.0.1:{os.environ.get(env_name, default_port)}"
    try:
        tls = credentials(args)
    except (OSError, ValueError) as e:
        print(f"{address}: {e}", file=sys.stderr)
        return 1
    options = (
        [("grpc.ssl_target_name_override", args.tls_server_name)] if tls and args.tls_server_name else []
    )
    try:
        channel = grpc.secure_channel(address, tls, options) if tls else grpc.insecure_channel(address)
        with channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=args.timeout
            )
    except grpc.RpcError as e:
        print(f"{address}: {e.code().name}{' (TLS)' if tls else ''}: {e.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    print(f"{address}: {status}")
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
