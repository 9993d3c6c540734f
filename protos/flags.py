"""A service's command-line flags as one table: each `Flag` is declared once (name, environment
twin, type, default, help) and `add_flags` turns the table into argparse arguments. The twin's
value, when set, replaces the default (argparse then applies `type` to it, as to any string
default), and `[TANDEM_X]` is written into the help here, not by each flag."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "TANDEM_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


@dataclass(frozen=True)
class Group:
    """An argparse argument group: a heading and a paragraph in --help."""

    title: str
    description: str | None = None


@dataclass(frozen=True)
class Flag:
    """One command-line flag and its TANDEM_<env> environment twin.

    `names`: the option strings, the first one canonical ("--port", or "--tensor-parallel-size",
    "-tp"). `env`: the twin without its prefix; `env_fallbacks` are older names read when it is
    unset. `switch` makes a store_true flag whose twin is on for 1 / true / yes / on, off for 0 /
    false / no / off or empty, and refused otherwise (a typo must not turn TLS or a check off
    unnoticed); a `negatable` switch also has --no-NAME (argparse's BooleanOptionalAction), for a
    switch on by default. A flag whose `required` is true is required only while its twin is unset."""

    names: tuple[str, ...]
    env: str
    help: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    choices: Sequence[Any] | None = None
    metavar: str | None = None
    dest: str | None = None
    switch: bool = False
    negatable: bool = False
    required: bool = False
    env_fallbacks: tuple[str, ...] = ()
    group: Group | None = None

    @property
    def env_names(self) -> tuple[str, ...]:
        return tuple(ENV_PREFIX + n for n in (self.env, *self.env_fallbacks))

    def environment_twin(self) -> tuple[str, str] | None:
        """(name, value) of the first twin that is set now, or None."""
        for name in self.env_names:
            value = os.environ.get(name)
            if value is not None:
                return name, value
        return None

    def environment_default(self) -> Any:
        """The default as the environment has it now: the first twin that is set, else `default`."""
        return self.default_for(self.environment_twin())

    def default_for(self, twin: tuple[str, str] | None) -> Any:
        """The default given environment_twin()'s answer; ValueError for a switch's twin that is
        neither on nor off."""
        if twin is not None:
            if not self.switch:
                return twin[1]
            value = twin[1].strip().lower()
            if value not in _TRUE | _FALSE:
                raise ValueError(
                    f"{twin[0]}={twin[1]!r}: a switch is on for 1, true, yes or on and off for 0, "
                    "false, no, off or empty"
                )
            return value in _TRUE
        return bool(self.default) if self.switch else self.default

    def full_help(self) -> str:
        twin = ENV_PREFIX + self.env + ("=1" if self.switch else "")
        return f"{self.help} [{twin}]"


def flag(*names: str, env: str, help: str, **options: Any) -> Flag:
    """`Flag(names, ...)` with the option strings written as in add_argument."""
    return Flag(names=names, env=env, help=help, **options)


def add_flags(parser: argparse.ArgumentParser, flags: Sequence[Flag]) -> dict[str, argparse.Action]:
    """Add the table's flags to `parser` (in groups where they name one); canonical name -> action.
    Each twin is read just before its flag is added, so the environment at parser-building time
    decides the defaults."""
    groups: dict[Group, argparse._ArgumentGroup] = {}
    actions: dict[str, argparse.Action] = {}
    for f in flags:
        target: argparse._ActionsContainer = parser
        if f.group is not None:
            if f.group not in groups:
                groups[f.group] = parser.add_argument_group(f.group.title, f.group.description)
            target = groups[f.group]
        twin = f.environment_twin()
        try:
            default = f.default_for(twin)
        except ValueError as e:  # a usage error, as argparse's own (exit status 2)
            if isinstance(parser, argparse.ArgumentParser):
                parser.error(str(e))
            sys.stderr.write(f"error: {e}\n")
            raise SystemExit(2) from None
        kwargs: dict[str, Any] = {"default": default, "help": f.full_help()}
        if f.switch:
            kwargs["action"] = argparse.BooleanOptionalAction if f.negatable else "store_true"
        else:
            kwargs.update(type=f.type, choices=f.choices, metavar=f.metavar)
            if twin is not None and (f.type is not None or f.choices is not None):
                kwargs["type"] = _naming_twin(f.type or str, *twin, f.choices)
        if f.dest is not None:
            kwargs["dest"] = f.dest
        if f.required:
            kwargs["required"] = default is None
        actions[f.names[0]] = target.add_argument(*f.names, **kwargs)
    return actions


def _naming_twin(
    convert: Callable[[str], Any], name: str, text: str, choices: Sequence[Any] | None = None
) -> Callable[[str], Any]:
    """`convert` (a flag's type), whose error for the twin's own value names the twin: argparse
    converts the twin as the flag's default, and would name only the flag. It checks a default
    against no `choices` either: the twin's value is checked here."""

    def parse(value: str) -> Any:
        try:
            result = convert(value)
        except (TypeError, ValueError):
            if value != text:
                raise
            raise argparse.ArgumentTypeError(
                f"invalid {parse.__name__} value: {value!r} (from {name})"
            ) from None
        if choices is not None and value == text and result not in choices:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {result!r} (from {name}) (choose from {', '.join(map(repr, choices))})"
            )
        return result

    parse.__name__ = getattr(convert, "__name__", repr(convert))  # argparse's "invalid int value"
    return parse
