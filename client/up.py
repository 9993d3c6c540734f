"""`tandem up`: the executor and the scheduler as two local subprocesses, stopped together.

The children run in their own sessions so that Ctrl-C reaches only this process, which then
stops them in order (scheduler first, so it drains for --shutdown-timeout; then the executor):
SIGTERM, a grace period, SIGKILL. A second Ctrl-C (or SIGTERM) kills both at once. On Linux each
child also gets SIGTERM if this process dies without cleanup.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from client.defaults import (
    DEFAULT_HOST,
    EXECUTOR_METRICS_PORT,
    EXECUTOR_PORT,
    HTTP_PORT,
    REPO_ROOT,
    SCHEDULER_METRICS_PORT,
    SCHEDULER_PORT,
    default_model,
    env,
)
from protos.defaults import INT32_MAX
from protos.flags import add_flags, flag
from protos.hub import resolve_model
from protos.service_main import PARENT_PID_ENV
from protos.vllm_flags import ENGINE, FRONTEND, add_foreign_flags, foreign

LOG_TAIL_LINES = 20


# The flags whose value `tandem up` passes on to a service, each with that service's own TANDEM_*
# twin: set in the environment, it reaches the service through up as it would without it. The
# defaults are up's (--shutdown-timeout: 5 s, not the scheduler's 30).
FLAGS = (
    flag("--tokenizer", env="TOKENIZER", help="tokenizer.json or its directory (default: the model's)"),
    flag("--device", env="DEVICE", default="cpu", help="cpu or cuda"),
    flag("--dtype", env="DTYPE", help="weights dtype (default: the checkpoint's)"),
    flag(
        "--port",
        env="SCHEDULER_PORT",
        type=int,
        default=SCHEDULER_PORT,
        help=f"scheduler gRPC port (default {SCHEDULER_PORT})",
    ),
    flag(
        "--executor-port",
        env="EXECUTOR_PORT",
        type=int,
        default=EXECUTOR_PORT,
        help=f"executor gRPC port (default {EXECUTOR_PORT})",
    ),
    flag(
        "--http-port",
        env="HTTP_PORT",
        type=int,
        default=HTTP_PORT,
        help=f"scheduler's OpenAI-compatible HTTP API port (default {HTTP_PORT}; 0: none)",
    ),
    flag(
        "--metrics-port",
        env="SCHEDULER_METRICS_PORT",
        type=int,
        default=SCHEDULER_METRICS_PORT,
        help=f"scheduler /metrics port (default {SCHEDULER_METRICS_PORT}; 0: none)",
    ),
    flag(
        "--executor-metrics-port",
        env="EXECUTOR_METRICS_PORT",
        type=int,
        default=EXECUTOR_METRICS_PORT,
        help=f"executor /metrics port (default {EXECUTOR_METRICS_PORT}; 0: none)",
    ),
    flag(
        "--max-num-seqs",
        env="MAX_NUM_SEQS",
        type=int,
        help="sequences per step at most (both services; default: theirs)",
    ),
    flag(
        "--shutdown-timeout",
        env="SHUTDOWN_TIMEOUT",
        env_fallbacks=("SCHEDULER_GRACE",),
        type=float,
        default=5.0,
        help="on Ctrl-C, seconds the scheduler lets requests in flight finish (default 5: this is a "
        "terminal session; a second Ctrl-C stops at once)",
    ),
)


# vLLM's serving flags that a service takes under the same name and meaning, passed on to it as
# given (not given: not passed, so that the service's own default or TANDEM_* twin applies).
# (option strings, the services that take it: executor, scheduler or both, type, help).
PASSED_ON = (
    (("--revision",), "executor", str, "branch, tag or commit of an ORG/NAME model (default main)"),
    (("--served-model-name",), "executor", str, "the model's name in the API (default: --model as given)"),
    (("--max-model-len",), "executor", int, "context limit in tokens (default: the model's)"),
    (("--gpu-memory-utilization",), "executor", float, "fraction of GPU memory the executor may use"),
    (("--tensor-parallel-size", "-tp"), "executor", int, "GPUs the model is split over"),
    (("--kv-cache-dtype",), "executor", str, "auto, bfloat16, float16, float32, fp8 or fp8_e4m3"),
    (("--quantization",), "executor", str, "fp8: quantize an unquantized checkpoint at load"),
    (("--block-size",), "executor", int, "tokens per KV block"),
    (("--seed",), "executor", int, "seed for requests without one of their own"),
    (("--max-num-batched-tokens",), "both", int, "most tokens in one step"),
    (("--max-logprobs",), "scheduler", int, "most top logprobs per token a request may ask for"),
    (("--api-key",), "scheduler", str, "clients must send it as a bearer token"),
    (("--allowed-origins",), "scheduler", str, "browser origins answered cross-origin (CORS)"),
    (("--tool-call-parser",), "scheduler", str, "auto, hermes, llama3_json or mistral"),
)
# Switches passed on only when given: (option strings, service, help).
SWITCHES_PASSED_ON = (
    (("--enforce-eager",), "executor", "never use CUDA graphs"),
    (("--enable-prefix-caching",), "scheduler", "reuse prompts' common prefixes (the default)"),
    (("--no-enable-prefix-caching",), "scheduler", "compute every prompt whole"),
)
# vLLM's TLS flags name the scheduler's certificate, but `up` waits for its services on plaintext.
UP_ONLY = (
    foreign(
        "--ssl-certfile",
        reason="tandem up serves plaintext on this machine: run tandem scheduler with --ssl-certfile "
        "and --ssl-keyfile (its --tls-cert and --tls-key)",
    ),
    foreign("--ssl-keyfile", reason="tandem up serves plaintext: see --ssl-certfile"),
)


def _add_passed_on(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group(
        "vLLM's flags, passed on to the service that takes them",
        "as vLLM's; not given, the service's own default (or TANDEM_* variable) applies",
    )
    for names, service, type_, text in PASSED_ON:
        group.add_argument(*names, type=type_, default=None, help=f"{text} ({service})")
    for names, service, text in SWITCHES_PASSED_ON:
        group.add_argument(
            *names, action="append_const", const=names[0], dest="switches", help=f"{text} ({service})"
        )


def passed_on(args: argparse.Namespace, service: str) -> list[str]:
    """The PASSED_ON and SWITCHES_PASSED_ON flags given that `service` takes, as its arguments."""
    argv: list[str] = []
    for names, to, _, _ in PASSED_ON:
        value = getattr(args, names[0][2:].replace("-", "_"))
        if value is not None and to in (service, "both"):
            argv += [names[0], str(value)]
    for names, to, _ in SWITCHES_PASSED_ON:
        if names[0] in (args.switches or ()) and to == service:
            argv.append(names[0])
    return argv


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "up",
        help="start the executor and the scheduler on this machine, and stop both on Ctrl-C",
        description="Start the executor service, then the scheduler service pointing at it, both on "
        "localhost; wait until both report SERVING; stop both on Ctrl-C or SIGTERM. A flag's "
        "environment variable (in brackets) is the service's own: set, it is passed on as the flag.",
    )
    p.add_argument(
        "model_positional",
        nargs="?",
        metavar="MODEL",
        help="the model, as `vllm serve MODEL` takes it: the same as --model",
    )
    p.add_argument(
        "--model",
        default=default_model(),
        help="checkpoint directory or a Hugging Face id in the local cache (default: the embedded model) "
        "[TANDEM_MODEL]",
    )
    p.add_argument(
        "--host",
        default=None,
        help=f"address both services listen on (default: each service's own TANDEM_SCHEDULER_HOST or "
        f"TANDEM_EXECUTOR_HOST, else {DEFAULT_HOST})",
    )
    add_flags(p, FLAGS)
    p.add_argument(
        "--executor-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the executor, e.g. --executor-arg=--kv-cache-gb=4 (repeatable)",
    )
    p.add_argument(
        "--scheduler-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the scheduler, e.g. --scheduler-arg=--max-queue=512 (repeatable)",
    )
    p.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds each service may take to be SERVING"
    )
    p.add_argument(
        "--grace",
        type=float,
        default=None,
        help="seconds between SIGTERM and SIGKILL on stop (default: the shutdown timeout + 10)",
    )
    p.add_argument("--log-dir", default=None, help="where the services' logs go (default: a new temp dir)")
    p.add_argument(
        "--prompt",
        default=None,
        help="once both serve, stream one generation for this prompt to the terminal, then keep serving",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate for --prompt (default 64)")
    _add_passed_on(p)
    add_foreign_flags(p, (*ENGINE, *FRONTEND, *UP_ONLY))
    p.set_defaults(func=run_up)


@dataclass
class Service:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    cwd: str | Path | None = None
    process: subprocess.Popen | None = None
    log_file: object = field(default=None, repr=False)

    def start(self) -> None:
        self.log_file = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop())
        self.process = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            # The child arms its parent-death signal itself (`exit_with_parent`): a preexec_fn
            # would run Python in the forked child of a threaded process, which can crash.
            env={**(self.env if self.env is not None else os.environ), PARENT_PID_ENV: str(os.getpid())},
            cwd=self.cwd,
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def tail(self, n: int = LOG_TAIL_LINES) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(collections.deque(f, maxlen=n))
        except OSError:
            return ""

    def stop(self, grace: float, hurry: threading.Event | None = None) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds, or as soon as `hurry` is set."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            while self.process.poll() is None:
                if hurry is not None and hurry.is_set():
                    self.process.kill()
                elif time.monotonic() > deadline:
                    print(f"{self.name} did not stop within {grace:.0f} s: killing it", file=sys.stderr)
                    self.process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(0.05)
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None


def service_hosts(args: argparse.Namespace) -> tuple[str, str]:
    """The addresses the executor and the scheduler listen on: --host for both, else each one's
    TANDEM_EXECUTOR_HOST / TANDEM_SCHEDULER_HOST, else 127.0.0.1."""
    if args.host is not None:
        return args.host, args.host
    return env("EXECUTOR_HOST") or DEFAULT_HOST, env("SCHEDULER_HOST") or DEFAULT_HOST


def service_argv(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The command lines of the executor and of the scheduler."""
    resolve_model_arg(args)
    executor_host, scheduler_host = service_hosts(args)
    executor = [sys.executable, "-m", "executor_service", "--model", args.model]
    executor += ["--host", executor_host, "--port", str(args.executor_port)]
    executor += ["--metrics-port", str(args.executor_metrics_port), "--device", args.device]
    if args.dtype:
        executor += ["--dtype", args.dtype]
    if args.max_num_seqs:
        executor += ["--max-num-seqs", str(args.max_num_seqs)]
    executor += passed_on(args, "executor")
    executor += args.executor_arg

    scheduler = [
        sys.executable,
        "-m",
        "scheduler_service",
        "--executor",
        f"{executor_host}:{args.executor_port}",
    ]
    scheduler += ["--host", scheduler_host, "--port", str(args.port)]
    scheduler += ["--metrics-port", str(args.metrics_port)]
    scheduler += ["--http-port", str(args.http_port)]
    scheduler += ["--tokenizer", args.tokenizer or args.model]
    scheduler += ["--shutdown-timeout", f"{args.shutdown_timeout:g}"]
    if args.max_num_seqs:
        scheduler += ["--max-num-seqs", str(args.max_num_seqs)]
    scheduler += passed_on(args, "scheduler")
    scheduler += args.scheduler_arg
    return executor, scheduler


def child_env() -> dict[str, str]:
    """This environment, with the directory that holds our packages importable by `python -m`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def _wait_serving(service: Service, address: str, timeout: float, stop: threading.Event) -> str | None:
    """None once SERVING; otherwise why not (the child died, the timeout, or a stop signal)."""
    from client.client import TandemClient
    from client.messages import TandemError

    deadline = time.monotonic() + timeout
    last = "no answer yet"
    with TandemClient(address) as client:
        while not stop.is_set():
            if not service.alive():
                return f"{service.name} exited with code {service.process.returncode}"
            try:
                last = client.health(timeout=1.0)
                if last == "SERVING":
                    return None
            except TandemError as e:
                last = e.code.name
            if time.monotonic() > deadline:
                return f"{service.name} not SERVING on {address} after {timeout:.0f} s (health: {last})"
            stop.wait(0.2)
    return "interrupted"


def resolve_model_arg(args: argparse.Namespace) -> None:
    """args.model from MODEL (vLLM's place for it) when given, else --model; ValueError when both
    are given and differ."""
    positional = args.model_positional
    if positional is not None and args.model not in (default_model(), positional):
        raise ValueError(f"the model is given twice: {positional!r} and --model {args.model!r}; give one")
    args.model = positional or args.model


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the first flag whose value cannot work, before anything starts (the
    services check theirs again)."""
    resolve_model_arg(args)
    for name, value in (("--max-num-seqs", args.max_num_seqs), ("--max-tokens", args.max_tokens)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
        if value is not None and value > INT32_MAX:  # the protos' int32, once both had started
            raise ValueError(f"{name} must be at most {INT32_MAX}, got {value}")
    if not 0 < args.startup_timeout < math.inf:
        raise ValueError(
            f"--startup-timeout must be a positive, finite number of seconds, got {args.startup_timeout}"
        )
    for name, value in (("--shutdown-timeout", args.shutdown_timeout), ("--grace", args.grace)):
        if value is not None and not 0 <= value < math.inf:  # NaN too
            raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value}")
    # The gRPC ports are waited on for SERVING: 0 (any free port) would never be found.
    for name, value in (("--port", args.port), ("--executor-port", args.executor_port)):
        if not 1 <= value <= 65535:
            raise ValueError(f"{name} must be in [1, 65535], got {value}")
    for name, value in (
        ("--http-port", args.http_port),
        ("--metrics-port", args.metrics_port),
        ("--executor-metrics-port", args.executor_metrics_port),
    ):
        if not 0 <= value <= 65535:
            raise ValueError(f"{name} must be in [0, 65535] (0: none), got {value}")
    # The second service to bind a port taken by the first failed once the first had loaded.
    executor_host, scheduler_host = service_hosts(args)
    taken: dict[tuple[str, int], str] = {}
    for host, name, value in (
        (executor_host, "--executor-port", args.executor_port),
        (executor_host, "--executor-metrics-port", args.executor_metrics_port),
        (scheduler_host, "--port", args.port),
        (scheduler_host, "--http-port", args.http_port),
        (scheduler_host, "--metrics-port", args.metrics_port),
    ):
        if value and (host, value) in taken:
            raise ValueError(
                f"{taken[host, value]} and {name} are both {value}: each needs a port of its own"
            )
        taken[host, value] = name


def run_up(args: argparse.Namespace) -> int:
    try:
        check_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # A Hugging Face id in the local cache: the executor gets the id itself and resolves it (with
    # TANDEM_REVISION, which it inherits), so that it serves the model under that name and not
    # under its snapshot's commit hash; the snapshot found here is checked, and is the scheduler's
    # tokenizer unless --tokenizer names another.
    try:
        checkpoint = resolve_model(args.model, args.revision or env("REVISION"))
        args.tokenizer = resolve_model(args.tokenizer) if args.tokenizer else checkpoint
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not (Path(checkpoint) / "config.json").is_file():
        print(
            f"error: --model {args.model!r} is not a checkpoint directory (no config.json)", file=sys.stderr
        )
        return 2
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="tandem-up-"))
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file there, a read-only place
        print(f"error: --log-dir {args.log_dir}: {e.strerror}", file=sys.stderr)
        return 2
    executor_argv, scheduler_argv = service_argv(args)
    executor = Service("executor", executor_argv, log_dir / "executor.log", env=child_env())
    scheduler = Service("scheduler", scheduler_argv, log_dir / "scheduler.log", env=child_env())
    # Stopped in this order: the scheduler drains its clients before the executor goes.
    services = [scheduler, executor]

    stop = threading.Event()
    hurry = threading.Event()  # a second signal: kill the services instead of draining
    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)
        if stop.is_set():
            hurry.set()
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    executor_host, scheduler_host = service_hosts(args)
    executor_address = f"{executor_host}:{args.executor_port}"
    scheduler_address = f"{scheduler_host}:{args.port}"
    try:
        for service, address in ((executor, executor_address), (scheduler, scheduler_address)):
            print(f"starting the {service.name} on {address} (log: {service.log_path})", flush=True)
            service.start()
            failure = _wait_serving(service, address, args.startup_timeout, stop)
            if failure == "interrupted":
                return 130 if signal.SIGINT in received else 0
            if failure is not None:
                _report_failure(failure, service)
                return 1
        name = args.served_model_name or served_name(args.model, checkpoint)
        _print_ready(args, name, executor, scheduler, executor_address, scheduler_address)
        if args.prompt:
            _demo(scheduler_address, args.prompt, args.max_tokens, args.api_key or env("API_KEY"))
        while not stop.wait(0.5):
            for service in services:
                if not service.alive():
                    _report_failure(f"{service.name} exited with code {service.process.returncode}", service)
                    return 1
        print(
            f"stopping: requests in flight have {args.shutdown_timeout:g} s to finish; Ctrl-C again "
            "stops at once",
            flush=True,
        )
        return 0
    finally:
        grace = args.grace if args.grace is not None else args.shutdown_timeout + 10.0
        for service in services:
            service.stop(grace, hurry)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _demo(address: str, prompt: str, max_tokens: int, api_key: str | None) -> None:
    """Stream one generation to the terminal, as `tandem generate` would."""
    from client.client import TandemClient
    from client.generate import _print_streaming
    from client.messages import TandemError

    print(f"\n$ tandem generate --server {address} {prompt!r} --max-tokens {max_tokens}", flush=True)
    try:
        # --api-key, or TANDEM_API_KEY, which the scheduler inherits from this environment.
        with TandemClient(address, api_key=api_key) as client:
            sys.stdout.write(prompt)
            _print_streaming(client.generate(prompt, max_tokens=max_tokens), sys.stdout)
    except TandemError as e:
        print(f"error: {e}", file=sys.stderr)


def _report_failure(reason: str, service: Service) -> None:
    print(f"error: {reason}; the last lines of {service.log_path}:", file=sys.stderr)
    for line in service.tail().splitlines():
        print(f"  | {line}", file=sys.stderr)


def served_name(model: str, checkpoint: str) -> str:
    """What the executor calls `--model` once `checkpoint` is what it resolved to (in Describe,
    /v1/models, the metrics' labels): a hub id as given, a directory by its name."""
    return model if checkpoint != model else Path(checkpoint).resolve().name


def _print_ready(
    args, name: str, executor: Service, scheduler: Service, executor_address: str, scheduler_address: str
):
    executor_host, scheduler_host = service_hosts(args)

    def metrics(host: str, port: int) -> str:
        return f"metrics http://{host}:{port}/metrics" if port else "no metrics"

    print(
        f"tandem is up ({name} on {args.device})\n"
        f"  scheduler  {scheduler_address}  {metrics(scheduler_host, args.metrics_port)}  "
        f"pid {scheduler.process.pid}\n"
        f"  executor   {executor_address}  {metrics(executor_host, args.executor_metrics_port)}  "
        f"pid {executor.process.pid}\n"
        f"  logs       {executor.log_path.parent}\n"
        f'try:  tandem generate --server {scheduler_address} "The list type" --max-tokens 64\n'
        + (
            f"      curl http://{scheduler_host}:{args.http_port}/v1/completions "
            "-H 'Content-Type: application/json' "
            """-d '{"prompt": "The list type", "max_tokens": 64}'\n"""
            if args.http_port
            else ""
        )
        + "Ctrl-C stops both.",
        flush=True,
    )
