"""The services' flag tables (protos/flags.py): one declaration per flag, its TANDEM_* twin written
into the help once, and the defaults that deployments rely on."""

from __future__ import annotations

import argparse

import pytest

from executor_service import cli as executor_cli
from protos.flags import add_flags, flag
from scheduler_service import cli as scheduler_cli
from tests.helpers.deploy import _env_value

CLIS = {"executor": executor_cli, "scheduler": scheduler_cli}
REQUIRED = {"scheduler": {"TANDEM_EXECUTOR_ADDRESS": "executor:50052"}, "executor": {}}


def _parse(verb, monkeypatch, environ=(), argv=()):
    for f in CLIS[verb].FLAGS:
        for name in f.env_names:
            monkeypatch.delenv(name, raising=False)
    for name, value in {**REQUIRED[verb], **dict(environ)}.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    CLIS[verb].add_arguments(parser)
    return parser, parser.parse_args(list(argv))


def test_key_defaults(monkeypatch):
    _, executor = _parse("executor", monkeypatch)
    _, scheduler = _parse("scheduler", monkeypatch)
    assert (executor.port, executor.metrics_port) == (50052, 9102)
    assert (scheduler.port, scheduler.metrics_port) == (50051, 9101)
    for args in (executor, scheduler):
        assert (args.max_num_seqs, args.max_num_batched_tokens) == (256, 8192)
    assert scheduler.shutdown_timeout == 30.0 and scheduler.max_plans_in_flight == 3
    assert scheduler.tool_call_parser == "auto"  # (the checkpoint's format: tool_call_formats.py)
    assert executor.enforce_eager is False and executor.kv_cache_dtype == "auto"


@pytest.mark.parametrize("verb", sorted(CLIS))
def test_every_flag_names_its_twin_once_and_reads_it(verb, monkeypatch):
    parser, defaults = _parse(verb, monkeypatch)
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    for f in CLIS[verb].FLAGS:
        action = actions[f.names[0]]
        twin = "TANDEM_" + f.env
        assert action.help.count(twin) == 1, f"{f.names[0]}: {action.help!r}"
        text, expected = _env_value(action, getattr(defaults, action.dest))
        _, parsed = _parse(verb, monkeypatch, {twin: text})
        assert getattr(parsed, action.dest) == expected, f"{twin}={text} did not set {f.names[0]}"


def test_the_flag_beats_its_twin_and_the_twin_beats_the_fallback(monkeypatch):
    env = {"TANDEM_SHUTDOWN_TIMEOUT": "4", "TANDEM_SCHEDULER_GRACE": "9"}
    _, args = _parse("scheduler", monkeypatch, env)
    assert args.shutdown_timeout == 4.0
    _, args = _parse("scheduler", monkeypatch, {"TANDEM_SCHEDULER_GRACE": "9"})
    assert args.shutdown_timeout == 9.0
    _, args = _parse("scheduler", monkeypatch, env, ["--grace", "2"])
    assert args.shutdown_timeout == 2.0


def test_a_required_flag_is_optional_once_its_twin_is_set(monkeypatch):
    monkeypatch.delenv("TANDEM_X_ADDRESS", raising=False)
    table = [flag("--executor", env="X_ADDRESS", required=True, help="address")]
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_flags(parser, table)
    with pytest.raises(SystemExit):
        parser.parse_args([])
    monkeypatch.setenv("TANDEM_X_ADDRESS", "h:1")
    parser = argparse.ArgumentParser()
    add_flags(parser, table)
    assert parser.parse_args([]).executor == "h:1"


def test_a_switch_twin_is_on_for_true_words(monkeypatch):
    table = [flag("--enforce-eager", env="ENFORCE_EAGER", switch=True, help="never use CUDA graphs")]
    for value, expected in (
        ("1", True),
        ("yes", True),
        ("ON", True),
        ("0", False),
        ("", False),
        ("off", False),
    ):
        monkeypatch.setenv("TANDEM_ENFORCE_EAGER", value)
        parser = argparse.ArgumentParser()
        (action,) = add_flags(parser, table).values()
        assert parser.parse_args([]).enforce_eager is expected
        assert action.help.endswith("[TANDEM_ENFORCE_EAGER=1]")


def test_a_switch_twin_that_is_neither_on_nor_off_is_refused(monkeypatch, capsys):
    """TANDEM_ENFORCE_EAGER=ture (a typo) was taken for off without a word. A usage error names the
    twin and the words it takes."""
    with pytest.raises(SystemExit) as e:
        _parse("executor", monkeypatch, {"TANDEM_ENFORCE_EAGER": "ture"})
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "TANDEM_ENFORCE_EAGER='ture': a switch is on for 1, true, yes or on and off for 0" in err


@pytest.mark.parametrize("verb", sorted(CLIS))
@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
@pytest.mark.parametrize("port", ["65536", "-1"])
def test_a_port_outside_the_tcp_range_is_refused_naming_its_flag(verb, flag, port, monkeypatch, capsys):
    """A port past 65535 was an OverflowError traceback from bind(), and a negative gRPC port was
    bound as 65536 minus it: both are refused before anything starts, naming the flag."""
    _, args = _parse(verb, monkeypatch, argv=["--port", "0", "--metrics-port", "0", flag, port])
    assert CLIS[verb].run(args) == 2
    assert f"{flag} must be in [0, 65535]" in capsys.readouterr().err


@pytest.mark.parametrize(
    "verb, flag",
    [
        ("scheduler", "--shutdown-timeout"),
        ("scheduler", "--executor-recovery-timeout"),
        ("scheduler", "--executor-step-timeout"),
        ("executor", "--grace"),
        ("executor", "--owner-lease-seconds"),
    ],
)
@pytest.mark.parametrize("seconds", ["nan", "inf", "-1"])
def test_a_duration_that_is_no_finite_number_of_seconds_is_refused(verb, flag, seconds, monkeypatch, capsys):
    """NaN passed every `< 0` check ("draining for up to nan s"; a NaN or negative recovery timeout
    was silently no limit at all, an infinite lease kept a dead scheduler the owner for ever)."""
    _, args = _parse(verb, monkeypatch, argv=["--port", "0", "--metrics-port", "0", flag, seconds])
    assert CLIS[verb].run(args) == 2
    assert f"{flag} must be a finite number of seconds >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("verb", sorted(CLIS))
def test_a_twin_that_does_not_parse_is_named_in_the_error(verb, monkeypatch, capsys):
    """Kubernetes' service links set TANDEM_EXECUTOR_PORT=tcp://10.0.0.1:50052 (README): argparse
    said "argument --port: invalid int value", naming a flag the command line did not have."""
    twin = {"executor": "TANDEM_EXECUTOR_PORT", "scheduler": "TANDEM_SCHEDULER_PORT"}[verb]
    with pytest.raises(SystemExit) as e:
        _parse(verb, monkeypatch, {twin: "tcp://10.0.0.1:50052"})
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --port: invalid int value: 'tcp://10.0.0.1:50052' (from {twin})" in err
    with pytest.raises(SystemExit):  # the flag's own bad value is the flag's
        _parse(verb, monkeypatch, argv=["--port", "x"])
    assert "argument --port: invalid int value: 'x'\n" in capsys.readouterr().err


@pytest.mark.parametrize(
    "address", ["", "executor", "localhost:abc", "127.0.0.1:99999", "127.0.0.1:0", ":50052"]
)
def test_an_executor_address_that_can_never_connect_is_refused(address, monkeypatch, capsys):
    """The scheduler served NOT_SERVING for ever, retrying an address gRPC could not even parse
    (a warning every 2 s); the executor may start later, but not at a malformed address."""
    _, args = _parse(
        "scheduler", monkeypatch, argv=["--port", "0", "--metrics-port", "0", "--executor", address]
    )
    assert scheduler_cli.run(args) == 2
    assert "--executor must be HOST:PORT with a port in [1, 65535]" in capsys.readouterr().err
    for target in ("executor:50052", "[::1]:50052", "dns:///executor:50052", "unix:/run/executor.sock"):
        assert scheduler_cli.check_executor_address(target) is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--max-num-batched-tokens", "1000000000000"],
            "max_num_batched_tokens (1000000000000) must be at most 2147483647",
        ),
        (["--num-kv-blocks", "1000000000000"], "num_kv_blocks (1000000000000) must be at most 2147483647"),
        (["--block-size", "1000000000000"], "block_size (1000000000000) must be at most 2147483647"),
        (
            ["--kv-cache-gb", "1000000000000"],
            "kv_cache_gb (1e+12) makes 21845333333333332 KV blocks of 16, more than",
        ),
        (
            ["--kv-cache-gb", "1e-7"],
            "the KV cache holds 0 tokens (0 blocks of 16 in kv_cache_gb 1e-07), fewer",
        ),
    ],
)
def test_an_executor_that_could_not_serve_what_it_loaded_is_refused_before_the_load(
    flags, message, monkeypatch, capsys
):
    """--max-num-batched-tokens 10**12 served, but Describe failed ("Value out of range") and no
    scheduler ever connected; a --kv-cache-gb too small for max_model_len, or of more blocks than
    Describe carries, was a traceback once the weights were loaded."""
    _, args = _parse("executor", monkeypatch, argv=["--port", "0", "--metrics-port", "0", *flags])
    assert executor_cli.run(args) == 2
    err = capsys.readouterr().err
    assert f"error: {message}" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        # Each one a process: 10**12 of them were spawned until the machine ran out of memory.
        (["--api-server-count", "1000000000000"], "--api-server-count must be in [0, 64] (0 = one process)"),
        (["--api-server-count", "-1"], "--api-server-count must be in [0, 64] (0 = one process), got -1"),
        # Half a client certificate was "the executor TLS client certificate and key go together".
        (["--executor-tls-cert", "c.pem"], "--executor-tls-cert and --executor-tls-key go together"),
        (["--executor-tls-key", "k.pem"], "--executor-tls-cert and --executor-tls-key go together"),
        # A server name without TLS to the executor was ignored without a word.
        (["--executor-tls-server-name", "executor"], "--executor-tls-server-name is the name in the"),
    ],
)
def test_scheduler_flags_that_cannot_work_are_refused_naming_them(flags, message, monkeypatch, capsys):
    _, args = _parse(
        "scheduler", monkeypatch, argv=["--port", "0", "--metrics-port", "0", "--http-port", "0", *flags]
    )
    assert scheduler_cli.run(args) == 2
    assert f"error: {message}" in capsys.readouterr().err


def test_an_executor_grace_past_what_threading_waits_is_waited_as_long_as_it_can(monkeypatch):
    """--grace 1e10 passed the finite-number check, then SIGTERM was an OverflowError traceback
    ("timestamp out of range for platform time_t") and exit code 1 in place of a shutdown."""
    from executor_service.metrics import ExecutorMetrics
    from executor_service.servicer import ExecutorServicer

    _, args = _parse("executor", monkeypatch, argv=["--grace", "1e10"])
    servicer = ExecutorServicer(ExecutorMetrics())
    servicer.close(timeout=args.grace)  # no step runs: returns at once


@pytest.mark.parametrize(
    ("verb", "twin", "value", "flag", "choices"),
    [
        ("scheduler", "TANDEM_MAX_PLANS_IN_FLIGHT", "9", "--max-plans-in-flight", "1, 2, 3"),
        ("scheduler", "TANDEM_TOOL_CALL_PARSER", "'pythonic'", "--tool-call-parser", "'auto', 'hermes'"),
        ("executor", "TANDEM_KV_CACHE_DTYPE", "'int8'", "--kv-cache-dtype", "'auto', 'bfloat16'"),
        ("executor", "TANDEM_FUSED_OPS", "'maybe'", "--fused-ops", "'auto', 'on', 'off'"),
    ],
)
def test_a_twin_outside_its_flags_choices_is_a_usage_error_naming_it(
    verb, twin, value, flag, choices, monkeypatch, capsys
):
    """argparse checks the choices of a flag's value but not of its default, which the twin is:
    TANDEM_MAX_PLANS_IN_FLIGHT=9 was "max_plans_in_flight must be 1, 2 or 3, got 9" (neither the
    flag nor the variable named), and TANDEM_KV_CACHE_DTYPE=int8 was refused only by the config."""
    with pytest.raises(SystemExit) as e:
        _parse(verb, monkeypatch, {twin: value.strip("'")})
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: invalid choice: {value} (from {twin}) (choose from {choices}" in err
    _, args = _parse(verb, monkeypatch, {twin: value.strip("'")}, [flag, "auto" if "'" in value else "2"])
    assert getattr(args, flag[2:].replace("-", "_")) in ("auto", 2)  # the flag beats its twin
