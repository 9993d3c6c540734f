#!/usr/bin/env python3
"""Container health probe: exit 0 when the service answers SERVING on grpc.health.v1, else 1.

    tandem-healthcheck scheduler             # 127.0.0.1:$TANDEM_SCHEDULER_PORT (default 50051)
    tandem-healthcheck executor              # 127.0.0.1:$TANDEM_EXECUTOR_PORT (default 50052)
    tandem-healthcheck --address HOST:PORT

Docker's HEALTHCHECK and compose's `healthcheck` run it inside the container; Kubernetes uses
its native `grpc:` probes on the same health service instead.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# The port each service listens on, as its CLI reads it: (environment variable, default).
PORTS = {"scheduler": ("TANDEM_SCHEDULER_PORT", 50051), "executor": ("TANDEM_EXECUTOR_PORT", 50052)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Exit 0 if the service reports SERVING on grpc.health.v1.")
    p.add_argument("service", nargs="?", choices=sorted(PORTS), default="scheduler")
    p.add_argument("--address", default=None, help="HOST:PORT (default: 127.0.0.1 and the service's port)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    args = p.parse_args(argv)
    env_name, default_port = PORTS[args.service]
    address = args.address or f"127.0.0.1:{os.environ.get(env_name, default_port)}"
    try:
        with grpc.insecure_channel(address) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=args.timeout
            )
    except grpc.RpcError as e:
        print(f"{address}: {e.code().name}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    print(f"{address}: {status}")
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
