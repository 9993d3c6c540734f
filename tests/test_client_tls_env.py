"""TANDEM_TLS for the clients (`tandem generate --server`, `tandem chat`) is read as the services
read their switches (protos.flags): on for 1 / true / yes / on, off for 0 / false / no / off or
empty, whatever the case or spaces, and any other value refused with a usage error naming it."""

from __future__ import annotations

import pytest

from client import cli
from protos.flags import flag

# What a service makes of a switch's twin set to the same value.
SERVICE_SWITCH = flag("--x", env="TLS", switch=True, help="")


def _tls(verb_argv: tuple[str, ...]) -> bool:
    return cli.build_parser(list(verb_argv)).parse_args(list(verb_argv)).tls


VERBS = [("generate", "x"), ("chat",)]


@pytest.mark.parametrize("argv", VERBS)
@pytest.mark.parametrize("value", ["false", "False", "no", "off", "0", "", " false "])
def test_tandem_tls_false_is_off(monkeypatch, argv, value):
    """TANDEM_TLS=false (or no, off) turned TLS on: anything but "" and "0" was taken for yes."""
    monkeypatch.setenv("TANDEM_TLS", value)
    assert _tls(argv) is False


@pytest.mark.parametrize("argv", VERBS)
@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "on", " On "])
def test_tandem_tls_true_is_on(monkeypatch, argv, value):
    monkeypatch.setenv("TANDEM_TLS", value)
    assert _tls(argv) is True


@pytest.mark.parametrize("argv", VERBS)
@pytest.mark.parametrize("value", ["maybe", "2", "enabled", "ture"])
def test_an_unrecognised_tandem_tls_is_refused_as_the_services_refuse_it(monkeypatch, capsys, argv, value):
    """A typo (TANDEM_TLS=ture) must not connect in plaintext unnoticed."""
    monkeypatch.setenv("TANDEM_TLS", value)
    with pytest.raises(SystemExit) as e:
        _tls(argv)
    assert e.value.code == 2
    assert f"TANDEM_TLS={value!r}: a switch is on for 1, true, yes or on" in capsys.readouterr().err
    with pytest.raises(ValueError, match="TANDEM_TLS"):
        SERVICE_SWITCH.environment_default()


def test_tls_flag_and_unset_twin(monkeypatch):
    monkeypatch.delenv("TANDEM_TLS", raising=False)
    assert _tls(("generate", "x")) is False
    assert _tls(("generate", "x", "--tls")) is True
    monkeypatch.setenv("TANDEM_TLS", "false")
    assert _tls(("chat", "--tls")) is True  # the flag wins
