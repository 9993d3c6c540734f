"""Listening ports that belong to one process, for every server of both services (gRPC and
/metrics): a port in use fails the start with one line naming the port and, where /proc tells,
the process that holds it ("port 50051 is already in use (pid 123: tandem scheduler ...)")."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import CollectorRegistry, start_http_server

# gRPC sets SO_REUSEPORT by default: a second server on the port would start and the kernel would
# split the connections between the two. Every gRPC server's options must include this.
EXCLUSIVE_PORT_OPTION = ("grpc.so_reuseport", 0)
# The scheduler service's API server processes share their port (a lock keeps other services off).
SHARED_PORT_OPTION = ("grpc.so_reuseport", 1)
_LISTEN = "0A"  # TCP state in /proc/net/tcp
_MAX_COMMAND_CHARS = 120


class PortInUseError(OSError):
    """The port is already bound by another socket (another process, or this one)."""


def bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def add_grpc_port(
    server: grpc.Server | grpc.aio.Server,
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None = None,
    shared: bool = False,
) -> int:
    """Bind `server` (built with EXCLUSIVE_PORT_OPTION) to host:port; returns the bound port
    (port 0 picks one). Raises PortInUseError or OSError naming the address. `shared`: one of a
    service's API server processes, which share the port (SO_REUSEPORT; their engine core holds
    the port's lock, port_lock)."""
    address = bind_address(host, port)
    if port and not shared:
        check_free(host, port)
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError as e:  # gRPC says only "Failed to bind to address"
        raise listen_error(host, port, str(e)) from None


def check_free(host: str, port: int) -> None:
    """PortInUseError naming the holder unless every address `host` names is free on `port`: gRPC
    binds each of them and starts if any one succeeds (`localhost` would get [::1]:P beside another
    server's 127.0.0.1:P)."""
    for resolved in _resolve(host, port):
        if _is_bound(resolved, port):
            raise listen_error(resolved, port, "address in use")


def bind_http_socket(host: str, port: int) -> socket.socket:
    """A listening socket for an HTTP server on host:port, without SO_REUSEPORT (port 0 picks one).
    Raises PortInUseError or OSError naming the address."""
    try:
        infos = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        raise listen_error(host, port, str(e)) from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise listen_error(host, port, e.strerror or str(e)) from None
    sock.setblocking(False)
    return sock


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> WSGIServer:
    """prometheus_client's /metrics server in a daemon thread, on a port of its own (the stdlib
    server sets SO_REUSEADDR only, which on Linux lets no second socket listen on the port)."""
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise listen_error(host, port, e.strerror or str(e)) from None
    return server


def listen_error(host: str, port: int, detail: str) -> OSError:
    """The error for a failed bind: PortInUseError when the port is taken, naming its holder."""
    holder = port_holder(port)
    if holder is not None or (port and _is_bound(host, port)):
        return PortInUseError(f"port {port} is already in use ({holder or 'by another process'})")
    return OSError(f"cannot listen on {bind_address(host, port)}: {detail}")


def port_holder(port: int) -> str | None:
    """'pid N: command line' of a process of ours listening on TCP `port`, from /proc (Linux);
    None where unknown (no /proc, or another user's process)."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    return _holder(proc)
        except OSError:  # gone, or not ours to read
            continue
    return "by a process of another user"


def _holder(proc: Path) -> str:
    """'pid N: command'; for an API server process of the scheduler service, its engine core's
    (the process that was started), with the API server's pid after it."""
    command = _command(proc)
    if "scheduler_service.api_server" in command:
        try:
            status = (proc / "status").read_text()
            parent = Path("/proc") / next(
                line.split()[1] for line in status.splitlines() if line.startswith("PPid:")
            )
            return f"pid {parent.name}: {_command(parent)}; its API server pid {proc.name}"
        except (OSError, StopIteration):
            pass
    return f"pid {proc.name}: {command}"


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    return inodes


def _command(proc: Path) -> str:
    command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    return command if len(command) <= _MAX_COMMAND_CHARS else command[: _MAX_COMMAND_CHARS - 3] + "..."


def _resolve(host: str, port: int) -> list[str]:
    """The addresses `host` names (one for a literal address; none when it does not resolve, for
    gRPC to report)."""
    try:
        infos = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror:
        return []
    return sorted({info[4][0] for info in infos})


def _is_bound(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def port_lock(host: str, port: int):
    """An exclusive lock on host:port for a service whose processes share the port (the scheduler
    service's API servers, SO_REUSEPORT): another such service on the port is refused here, as
    an exclusive bind refuses one process's second server. Kept open (and so held) for the life of
    the returned file; raises PortInUseError naming the holder."""
    import fcntl
    import tempfile

    folder = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / "tandem-ports"
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / f"{host.strip('[]').replace(':', '_') or 'any'}-{port}.lock"
    lock = open(path, "a+")  # noqa: SIM115 (held open on purpose)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise PortInUseError(f"port {port} is already in use ({holder})") from None
    lock.seek(0)
    lock.truncate()
    lock.write(
        f"pid {os.getpid()}: {_command(Path('/proc/self'))}"
        if Path("/proc/self").exists()
        else f"pid {os.getpid()}"
    )
    lock.flush()
    return lock
