"""The `tandem` command line: generate (through a server, or in-process), up, executor, scheduler."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys

from client.defaults import DEFAULT_SERVER, add_connection_flags, env
from protos.service_main import LOG_FORMAT, add_log_level, run_service

# The service verbs live with their services; they are imported only when used, so that
# `tandem generate --server` needs neither torch (executor) nor the scheduler's internals.
SERVICE_VERBS = {
    "executor": ("executor_service.cli", "run the executor service: model weights, KV cache, kernels"),
    "scheduler": ("scheduler_service.cli", "run the scheduler service: requests, batching, streaming"),
}


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids takes comma-separated integers, got {text!r}"
        ) from None


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text from prompts, through a server (default) or in-process (--model)",
        description="Generate from one or more prompts, all in one batch. Without --json the first "
        "prompt's text streams to the terminal as it is generated.",
    )
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (several: generated together)")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--server",
        default=None,
        help=f"scheduler address HOST:PORT (default {DEFAULT_SERVER}; env TANDEM_SERVER)",
    )
    where.add_argument(
        "--model", default=None, help="checkpoint directory or cached ORG/NAME: run in-process, no server"
    )
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeat for several prompts)")
    p.add_argument(
        "--prompt-ids", type=_token_ids, action="append", default=[], help="prompt as token ids: 1,2,3"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="tokens to generate at most (default 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (1: off)")
    p.add_argument("--min-p", type=float, default=None, help="drop tokens below min_p x the top probability")
    p.add_argument("--seed", type=int, default=None, help="per-request seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=None, help="stop when this string appears (repeatable)")
    p.add_argument(
        "--stop-token-id",
        dest="stop_token_ids",
        type=int,
        action="append",
        default=None,
        help="stop at this token id (repeatable)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--repetition-penalty", type=float, default=None, help="1: off (default)")
    p.add_argument("--presence-penalty", type=float, default=None, help="0: off (default)")
    p.add_argument("--frequency-penalty", type=float, default=None, help="0: off (default)")
    p.add_argument(
        "--logprobs", type=int, default=None, help="top logprobs per token (adds `logprobs` to --json)"
    )
    p.add_argument("--n", type=int, default=None, help="samples per prompt (default 1; each printed whole)")
    p.add_argument(
        "--min-tokens", type=int, default=None, help="end-of-sequence and stop strings wait this many tokens"
    )
    p.add_argument(
        "--logit-bias",
        type=_logit_bias,
        action="append",
        default=None,
        metavar="ID=BIAS",
        help="add BIAS (-100..100) to token ID's logit (repeatable)",
    )
    p.add_argument(
        "--prompt-logprobs",
        type=int,
        default=None,
        help="logprobs of the prompt's tokens with N alternatives (adds `prompt_logprobs` to --json)",
    )
    p.add_argument(
        "--include-stop-str-in-output",
        action="store_true",
        default=None,
        help="keep the stop string (or stop token's text) at the end of the text",
    )
    p.add_argument(
        "--no-skip-special-tokens",
        dest="skip_special_tokens",
        action="store_false",
        default=None,
        help="write special tokens (end-of-sequence, ...) in the text",
    )
    p.add_argument(
        "--truncate-prompt-tokens",
        type=int,
        default=None,
        metavar="K",
        help="keep only the prompt's last K tokens (-1: max_model_len)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt, when it is done")
    server = p.add_argument_group("with --server")
    add_connection_flags(server)
    server.add_argument("--user", default="", help="the end user the request is for (logged by the server)")
    local = p.add_argument_group("with --model (in-process)")
    local.add_argument(
        "--tokenizer", default=None, help="tokenizer.json or its directory (default: the model's)"
    )
    local.add_argument(
        "--revision", default=env("REVISION"), help="of an ORG/NAME --model (env TANDEM_REVISION)"
    )
    local.add_argument("--device", default=env("DEVICE", "cpu"), help="cpu or cuda (env TANDEM_DEVICE)")
    local.add_argument("--dtype", default=env("DTYPE"), help="weights dtype (default: the checkpoint's)")
    local.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    p.set_defaults(func=_generate)


SAMPLING_ARGS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "n",
    "min_tokens",
    "logit_bias",
    "prompt_logprobs",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "truncate_prompt_tokens",
)


def _logit_bias(text: str) -> tuple[int, float]:
    try:
        token_id, bias = text.split("=")
        return int(token_id), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--logit-bias takes ID=BIAS (e.g. 42=100), got {text!r}") from None


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """The sampling flags that were given, as keyword arguments of SamplingParams / the client."""
    kwargs = {name: getattr(args, name) for name in SAMPLING_ARGS if getattr(args, name) is not None}
    if not kwargs.get("ignore_eos"):
        kwargs.pop("ignore_eos", None)
    if "logit_bias" in kwargs:
        kwargs["logit_bias"] = dict(kwargs["logit_bias"])
    return kwargs


def prompts_of(args: argparse.Namespace) -> list[str] | list[list[int]]:
    texts = list(args.prompts) + list(args.prompt)
    if texts and args.prompt_ids:
        raise ValueError("give text prompts or --prompt-ids, not both")
    if not texts and not args.prompt_ids:
        raise ValueError('no prompt: tandem generate "The list type" (or --prompt / --prompt-ids)')
    return texts or args.prompt_ids


def server_address(args: argparse.Namespace) -> str:
    return args.server or env("SERVER") or DEFAULT_SERVER


def _generate(args: argparse.Namespace) -> int:
    try:
        prompts = prompts_of(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if args.model is not None:
            return _print_in_process(args, prompts)
        from client.generate import generate_remote

        return generate_remote(server_address(args), prompts, args, sampling_kwargs(args))
    except BrokenPipeError:  # stdout's reader is gone (`| head`): stop without a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python flushes it at exit)
        return 1


def _print_in_process(args: argparse.Namespace, prompts) -> int:
    from client.llm import LLM
    from client.messages import logprobs_json, usage_json
    from scheduler_service.sampling_params import SamplingParams

    try:
        params = SamplingParams(**sampling_kwargs(args))
        llm = LLM(
            args.model,
            tokenizer=args.tokenizer,
            revision=args.revision,
            device=args.device,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
        )
        # As with --server: without --json the first prompt's text streams as it is generated
        # (n samples are printed whole, one after another).
        streamed = not args.json and params.n == 1 and llm.tokenizer is not None
        outputs = llm.generate(prompts, params, use_tqdm=False, on_text=_write_now if streamed else None)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        return 130
    for k, out in enumerate(outputs):
        for sample in out.outputs:
            if streamed and k == 0:
                print(flush=True)  # its text is out: the end of its line
            elif args.json:
                line = {
                    "token_ids": sample.token_ids,
                    "text": sample.text,
                    "finish_reason": sample.finish_reason,
                    "usage": usage_json(
                        len(out.prompt_token_ids), len(sample.token_ids), out.num_cached_tokens
                    ),
                }
                if len(out.outputs) > 1:
                    line["index"] = sample.index
                if sample.logprobs is not None:
                    line["logprobs"] = logprobs_json(sample.logprobs)
                if out.prompt_logprobs is not None:
                    line["prompt_logprobs"] = [None, *logprobs_json(out.prompt_logprobs[1:])]
                print(json.dumps(line))
            else:
                print(sample.text if sample.text is not None else " ".join(map(str, sample.token_ids)))
    return 0


def _write_now(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _add_service_parsers(sub: argparse._SubParsersAction, command: str | None) -> None:
    for verb, (module, help_text) in SERVICE_VERBS.items():
        if verb != command:
            # A stand-in that only lists the verb in `tandem --help`; never parsed.
            sub.add_parser(verb, help=help_text, add_help=False)
            continue
        try:
            importlib.import_module(module).add_parser(sub)
        except ImportError as e:
            p = sub.add_parser(verb, help=help_text)
            p.set_defaults(func=lambda _args, m=module, e=e: _missing(m, e))


def _missing(module: str, error: ImportError) -> int:
    extra = " (pip install 'tandem[executor]')" if module.startswith("executor") else ""
    print(f"error: cannot import {module}: {error}{extra}", file=sys.stderr)
    return 2


def _command_of(argv: list[str]) -> str | None:
    """The verb: the first argument that is neither an option nor an option's value."""
    it = iter(argv)
    for arg in it:
        if arg == "--log-level":
            next(it, None)
        elif not arg.startswith("-"):
            return arg
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    from client import chat, up

    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="tandem", description="LLM serving: a CPU scheduler and a GPU executor"
    )
    add_log_level(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_generate_parser(sub)
    chat.add_parser(sub)
    up.add_parser(sub)
    _add_service_parsers(sub, _command_of(argv))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command in SERVICE_VERBS:
        return run_service(args)
    logging.basicConfig(level=(args.log_level or "WARNING").upper(), format=LOG_FORMAT)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
