"""`tandem chat`: an interactive conversation with a server, each reply streamed as it is generated.
The server renders the conversation with the model's chat template (gRPC's Chat prompt)."""

from __future__ import annotations

import argparse
import sys

import grpc

from client.defaults import DEFAULT_SERVER, add_connection_flags, env
from client.generate import _error, client_from_args
from client.messages import Chunk, CompletionBuilder, TandemError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat",
        help="chat with a server interactively (the model's chat template; replies stream)",
        description="Type a message and press Enter; an empty line or Ctrl-D ends the conversation.",
    )
    p.add_argument(
        "--server",
        default=None,
        help=f"scheduler address HOST:PORT (default {DEFAULT_SERVER}; env TANDEM_SERVER)",
    )
    p.add_argument("--system", default=None, help="a system message that opens the conversation")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per reply at most (default 512)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--seed", type=int, default=None, help="per-request seed for reproducible sampling")
    p.add_argument("--no-thinking", action="store_true", help="Qwen3: enable_thinking=false in the template")
    add_connection_flags(p)
    p.set_defaults(func=run_chat)


# What a server answers a message it will not take; at a terminal the conversation goes on without
# it (piped, the command fails, as a script expects). Anything else (no server, a wrong key) ends it.
_MESSAGE_REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


def run_chat(args: argparse.Namespace, stdin=None, out=None) -> int:
    stdin, out = stdin or sys.stdin, out or sys.stdout
    address = args.server or env("SERVER") or DEFAULT_SERVER
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.seed is not None:
        sampling["seed"] = args.seed
    kwargs = {"enable_thinking": False} if args.no_thinking else None
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = stdin.isatty()
    client = client_from_args(address, args)
    if client is None:
        return 2
    with client:
        while True:
            if interactive:
                out.write("> ")
                out.flush()
            try:
                line = stdin.readline()
            except KeyboardInterrupt:  # Ctrl-C at the prompt ends the conversation, as during a reply
                out.write("\n")
                return 130
            if not line.strip():
                if interactive and not line:  # Ctrl-D: the shell's prompt on a line of its own
                    out.write("\n")
                return 0
            messages.append({"role": "user", "content": line.rstrip("\n")})
            try:
                stream = client.chat(messages, chat_template_kwargs=kwargs, **sampling)
            except (TypeError, ValueError) as e:  # a flag's value the request cannot carry
                print(f"error: {e}", file=sys.stderr)
                return 2
            try:
                reply = _print_reply(stream, out)
            except TandemError as e:
                if interactive and e.code in _MESSAGE_REFUSED:
                    # This message was refused (too long, the queue full): the conversation goes on
                    # without it, as typed so far.
                    print(f"error: {e}", file=sys.stderr)
                    messages.pop()
                    continue
                return _error(e, address, client)
            except KeyboardInterrupt:
                stream.cancel()
                out.write("\n")
                return 130
            messages.append({"role": "assistant", "content": reply})


def _print_reply(stream, out) -> str:
    """Write a reply as it streams: its reasoning between <think> and </think>, its content, then
    its tool calls; returns the content (what the conversation keeps)."""
    builder = CompletionBuilder()
    thinking = False
    for item in stream:
        builder.add(item)
        if not isinstance(item, Chunk):
            continue
        if item.reasoning_content:
            out.write(("" if thinking else "<think>") + item.reasoning_content)
            thinking = True
        if item.text:
            out.write(("</think>\n" if thinking else "") + item.text)
            thinking = False
        out.flush()
    reply = builder.build()
    if thinking:
        out.write("</think>")
    for call in reply.tool_calls:
        out.write(f"\n[tool call] {call.name}({call.arguments})")
    out.write("\n")
    out.flush()
    return reply.text
