"""`tandem generate --server`: every prompt in flight at once, the first one streamed to stdout."""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from client.client import GenerationStream, TandemClient
from client.messages import Chunk, Completion, CompletionBuilder, SamplesBuilder, TandemError, logprobs_json


def _error(e: TandemError, address: str, client: TandemClient) -> int:
    unreachable = e.code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in e.message
    # A server that is there but whose TLS does not match the client's: "no tandem server ... start
    # one" would send the user to start a second server on a port in use. gRPC reports a failed
    # handshake (an untrusted certificate, or TLS to a plaintext port) as "Tls handshake failed",
    # and a TLS server closes a plaintext client's connection: "Socket closed".
    if unreachable and "handshake failed" in e.message.lower():
        print(
            f"error: the TLS handshake with {address} failed ({e}): --tls-ca must be the CA that "
            "signed the server's certificate (--tls-server-name a name it carries), and the server "
            "must serve TLS (--tls-cert)",
            file=sys.stderr,
        )
        return 1
    if unreachable and "socket closed" in e.message.lower() and not client.tls:
        print(
            f"error: {address} closed the connection ({e}): a server that serves TLS (--tls-cert) "
            "takes only TLS clients: connect with --tls-ca (or --tls)",
            file=sys.stderr,
        )
        return 1
    # A --timeout shorter than the retries ends DEADLINE_EXCEEDED, whatever the attempts met.
    if unreachable or (e.code == grpc.StatusCode.DEADLINE_EXCEEDED and not client.reachable(0.5)):
        print(f"error: no tandem server at {address} ({e}); start one with `tandem up`", file=sys.stderr)
        return 1
    print(f"error: {e}", file=sys.stderr)
    return 2 if e.code == grpc.StatusCode.INVALID_ARGUMENT else 1


def completion_json(completion: Completion, with_index: bool) -> dict:
    """`--json`'s line: token ids, text, finish reason, usage, and logprobs when asked for."""
    line = completion.to_json()
    if with_index:
        line["index"] = completion.index
    if completion.logprobs is not None:
        line["logprobs"] = logprobs_json(completion.logprobs)
    if completion.prompt_logprobs is not None:
        line["prompt_logprobs"] = [None, *logprobs_json(completion.prompt_logprobs)]
    return line


def _print_streaming(stream: GenerationStream, out) -> CompletionBuilder:
    """Write text deltas as they arrive; token ids at the end when the server sends no text."""
    builder = CompletionBuilder()
    for item in stream:
        builder.add(item)
        if isinstance(item, Chunk) and item.text:
            out.write(item.text)
            out.flush()
    if not "".join(builder.text) and builder.token_ids:
        out.write(" ".join(map(str, builder.token_ids)))
    out.write("\n")
    out.flush()
    return builder


def client_from_args(address: str, args: argparse.Namespace) -> TandemClient | None:
    """The client the CLI's connection flags describe; None, with the error printed, for bad ones."""
    try:
        return TandemClient(
            address,
            timeout=args.timeout,
            api_key=args.api_key,
            tls=args.tls,
            tls_ca=args.tls_ca,
            tls_server_name=args.tls_server_name,
            retries=args.retries,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def generate_remote(address: str, prompts: list, args: argparse.Namespace, sampling: dict) -> int:
    out = sys.stdout
    status = 0
    client = client_from_args(address, args)
    if client is None:
        return 2
    with client:
        # Start every request before reading any: the server batches them together.
        try:
            streams = [client.generate(p, user=getattr(args, "user", ""), **sampling) for p in prompts]
        except (TypeError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        several = (sampling.get("n") or 1) > 1
        try:
            for stream in streams:
                try:
                    if args.json or several:  # n samples are printed whole, one after another
                        builder = SamplesBuilder()
                        for item in stream:
                            builder.add(item)
                        completions = builder.build()
                    else:
                        completions = [_print_streaming(stream, out).build()]
                except TandemError as e:
                    status = status or _error(e, address, client)
                    if e.code == grpc.StatusCode.UNAVAILABLE:
                        break
                    continue
                for completion in completions:
                    if args.json:
                        print(json.dumps(completion_json(completion, several)), flush=True)
                    elif several:
                        print(completion.text or " ".join(map(str, completion.token_ids)), flush=True)
                    if completion.finish_reason == "abort":
                        print("error: the server aborted the request", file=sys.stderr)
                        status = status or 1
        except KeyboardInterrupt:
            out.write("\n")
            status = 130
        finally:
            for stream in streams:
                if not stream.done:
                    stream.cancel()
    return status
