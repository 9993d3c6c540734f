"""vLLM's `vllm serve` flags that tandem has no flag of its own for, so that a pasted vLLM command
line either starts what it asked for or stops at once naming the flag. Each `Foreign` flag is
refused with what to use here instead, except for the values that ask for what tandem does anyway
(`--pipeline-parallel-size 1`) and for the flags that change nothing a request can see (a log
setting, CPU swap space), which are accepted with a note on stderr. The flags that tandem serves
are in the services' own tables (protos/flags.py), under vLLM's names where the meaning is vLLM's."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Foreign:
    """A vLLM flag that tandem does not serve. `nargs` is argparse's (0: a switch). `accepted`: the
    values that mean what tandem does anyway; `ignored`: any value (or the switch) changes nothing
    here. Otherwise the flag is a usage error, and `reason` says why and what to use instead."""

    names: tuple[str, ...]
    reason: str
    nargs: int | str | None = None
    accepted: tuple[str, ...] = ()
    ignored: bool = False


def foreign(*names: str, reason: str, **options) -> Foreign:
    """`Foreign(names, ...)` with the option strings written as in add_argument."""
    return Foreign(names=names, reason=reason, **options)


class ForeignAction(argparse.Action):
    """Refuses its flag (a usage error, exit status 2), or notes on stderr that it changes nothing."""

    def __init__(self, option_strings, dest, foreign: Foreign, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.foreign = foreign

    def __call__(self, parser, namespace, values, option_string=None):
        f = self.foreign
        given = " ".join([option_string, *([values] if isinstance(values, str) else values or [])])
        if f.ignored or (isinstance(values, str) and values in f.accepted):
            print(f"note: vLLM's {given} changes nothing here: {f.reason}", file=sys.stderr)
            return
        parser.error(f"{given}: not served by tandem: {f.reason}")


def add_foreign_flags(parser: argparse.ArgumentParser, flags: Sequence[Foreign]) -> None:
    """Add vLLM's flags of the table to `parser`, in a group of their own in --help; none of them
    sets anything in the parsed Namespace."""
    group = parser.add_argument_group(
        "vLLM's flags that tandem does not serve",
        "taken so that a vllm serve command line can be pasted: refused naming what to use instead, "
        "or (where noted) accepted without effect",
    )
    for f in flags:
        group.add_argument(
            *f.names,
            action=ForeignAction,
            foreign=f,
            nargs=f.nargs,
            metavar="VALUE",
            dest="vllm_" + f.names[0].lstrip("-").replace("-", "_"),
            default=argparse.SUPPRESS,
            help=("accepted, no effect: " if f.ignored else "refused: ") + f.reason
            if not f.accepted
            else f"only {' or '.join(f.accepted)}: {f.reason}",
        )


# The engine's flags (the executor's side).
ENGINE = (
    foreign(
        "--pipeline-parallel-size",
        "-pp",
        accepted=("1",),
        reason="there is no pipeline parallelism: use --tensor-parallel-size",
    ),
    foreign(
        "--data-parallel-size",
        "-dp",
        accepted=("1",),
        reason="one executor is one replica: run several scheduler and executor pairs behind a load balancer",
    ),
    foreign("--speculative-config", reason="there is no speculative decoding"),
    foreign("--enable-lora", nargs=0, reason="there are no LoRA adapters: serve a merged checkpoint"),
    foreign("--max-loras", reason="there are no LoRA adapters: serve a merged checkpoint"),
    foreign(
        "--download-dir",
        reason="tandem never downloads; it reads checkpoint directories and the Hugging Face cache "
        "(set HF_HUB_CACHE or HF_HOME)",
    ),
    foreign(
        "--trust-remote-code",
        nargs=0,
        ignored=True,
        reason="only tandem's built-in architectures run, never a checkpoint's code",
    ),
    foreign(
        "--swap-space",
        ignored=True,
        reason="preempted requests are recomputed, never swapped to CPU memory (as in vLLM v1)",
    ),
)

# The frontend's flags (the scheduler's side).
FRONTEND = (
    foreign("--lora-modules", nargs="+", reason="there are no LoRA adapters: serve a merged checkpoint"),
    foreign(
        "--limit-mm-per-prompt", reason="there are no multimodal inputs: the models served take text only"
    ),
    foreign(
        "--chat-template",
        reason="the checkpoint's own template is rendered (chat_template.jinja, else tokenizer_config.json's "
        "chat_template): put yours there as chat_template.jinja",
    ),
    foreign(
        "--response-role",
        accepted=("assistant",),
        reason="chat answers always have the role assistant",
    ),
    foreign(
        "--generation-config",
        accepted=("vllm",),
        reason="sampling defaults are vLLM's own (its --generation-config vllm); a checkpoint's "
        "generation_config.json is not read",
    ),
    foreign(
        "--reasoning-parser",
        accepted=("qwen3",),
        reason="reasoning is split as vLLM's qwen3 parser splits it, always, for chat templates that "
        "write <think> blocks; no other parser is served",
    ),
    foreign(
        "--enable-auto-tool-choice",
        nargs=0,
        ignored=True,
        reason="tool calls are always read when a request gives tools (see --tool-call-parser)",
    ),
    foreign(
        "--enable-chunked-prefill",
        nargs=0,
        ignored=True,
        reason="prefills are always chunked, by --max-num-batched-tokens",
    ),
    foreign(
        "--no-enable-chunked-prefill",
        nargs=0,
        reason="prefills are always chunked: raise --max-num-batched-tokens to take prompts in fewer steps",
    ),
    foreign(
        "--disable-log-requests", nargs=0, ignored=True, reason="set the log level with tandem --log-level"
    ),
    foreign(
        "--disable-log-stats", nargs=0, ignored=True, reason="no periodic stats are logged; see /metrics"
    ),
    foreign(
        "--uvicorn-log-level",
        ignored=True,
        reason="there is no uvicorn; set the log level with tandem --log-level",
    ),
)
