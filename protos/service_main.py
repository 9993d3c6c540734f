"""How a service process starts: `python -m executor_service` and `python -m scheduler_service`
(what `tandem up` runs) and the `tandem executor` / `tandem scheduler` verbs parse and log alike."""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable

# Set by `tandem up` in the environment of the services it starts.
PARENT_PID_ENV = "TANDEM_PARENT_PID"
_PR_SET_PDEATHSIG = 1
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def exit_with_parent() -> None:
    """In a service started by `tandem up`: get SIGTERM from the kernel when `tandem up` dies,
    even by SIGKILL, so that no service is left orphaned. Does nothing elsewhere."""
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


# Whether this process is a service (mark_service_process): only then does freeze_startup_heap act.
_SERVICE_PROCESS = False


def mark_service_process() -> None:
    """This process runs a service (a `tandem` service verb, an API server, a tensor-parallel rank),
    not a library inside someone else's program (the in-process LLM, a test): its heap may be frozen."""
    global _SERVICE_PROCESS
    _SERVICE_PROCESS = True


def freeze_startup_heap() -> None:
    """In a service process (mark_service_process), once it has started (model loaded, graphs
    captured, sockets bound): move every object alive now out of the cyclic garbage collector's
    reach, as vLLM's engine core does. The steps that follow allocate and free a few hundred
    containers each; every ~700 of them Python runs a collection, and each 10th of those a larger
    one, each 100th a full one that walks the whole heap: ~30 ms for the engine core's ~110k objects
    on a 2-core CPU (bench/engine_core_overhead.py counts them), a pause every running stream feels. Frozen objects are never collected, which
    is right for what a service builds once and keeps, and wrong inside another program, whose
    objects it would keep forever once they become garbage in cycles: elsewhere this does nothing."""
    if not _SERVICE_PROCESS:
        return
    gc.collect()
    gc.freeze()


def add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        default=os.environ.get("TANDEM_LOG_LEVEL"),
        help="logging level (default INFO for the services, WARNING otherwise; env TANDEM_LOG_LEVEL)",
    )


def service_main(verb: str, add_parser: Callable[[argparse._SubParsersAction], object]) -> int:
    """`python -m executor_service [executor] [--log-level L] [flags]` and its scheduler twin:
    the same as `tandem VERB [flags]`."""
    argv = sys.argv[1:]
    if argv[:1] == [verb]:
        argv = argv[1:]
    log_level = []
    if argv[:1] == ["--log-level"]:
        log_level, argv = argv[:2], argv[2:]
    parser = argparse.ArgumentParser(prog="tandem")
    add_log_level(parser)
    add_parser(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args([*log_level, verb, *argv])
    try:
        return run_service(args)
    finally:
        ignore_shutdown_signals()


def ignore_shutdown_signals() -> None:
    """Once a service process's shutdown is done: a later SIGTERM or SIGINT (the rest of a burst,
    a supervisor's then a user's) is ignored. Python puts back the default action of the signals it
    handled as the interpreter exits, and that default would end the process by the signal (exit
    code -2 or -15) in place of the code its shutdown returned; an ignored signal stays ignored."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def run_service(args: argparse.Namespace) -> int:
    """Run a parsed service verb: tied to `tandem up` when it started us, logging at INFO. The
    process counts as a service while the verb runs: a caller that runs one in-process (a test of
    the CLI) gets its unfrozen heap back, and freezes nothing after."""
    global _SERVICE_PROCESS
    mark_service_process()
    try:
        exit_with_parent()
        logging.basicConfig(level=(args.log_level or "INFO").upper(), format=LOG_FORMAT)
        return args.func(args)
    finally:
        _SERVICE_PROCESS = False
        gc.unfreeze()
