"""Who drives an executor: the gRPC metadata a scheduler sends on every ExecutorService call.

A scheduler process draws a random session id once and names itself in human words; the executor
gives Reset and Step to one session at a time, its owner (executor_service/ownership.py), and
names the owner when it refuses anyone else. The metadata carries no secret: who may call at all
is the API key's and mutual TLS's business."""

from __future__ import annotations

import os
import secrets
import socket

SESSION_ID = "tandem-session-id"
SESSION_OWNER = "tandem-session-owner"
# Metadata values stay small: a longer owner name is cut.
MAX_OWNER_CHARS = 200


def new_session_id() -> str:
    return secrets.token_hex(16)


def default_owner_name(what: str = "scheduler") -> str:
    """E.g. `scheduler on host-1 pid 4242`."""
    return f"{what} on {socket.gethostname()} pid {os.getpid()}"


def session_metadata(session_id: str, owner: str) -> list[tuple[str, str]]:
    # Metadata values must be printable ASCII.
    printable = "".join(c if " " <= c <= "~" else "?" for c in owner[:MAX_OWNER_CHARS])
    return [(SESSION_ID, session_id), (SESSION_OWNER, printable)]
