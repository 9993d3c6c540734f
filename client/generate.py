"""`tandem generate --server`: every prompt in flight at once, the first one streamed to stdout."""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from client.client import GenerationStream, TandemClient
from client.defaults import DEFAULT_RETRIES
from client.messages import Chunk, CompletionBuilder, TandemError


def _logprobs_json(logprobs) -> list[dict]:
    return [
        {"token_id": lp.token_id, "logprob": lp.logprob, "top_logprobs": [list(t) for t in lp.top_logprobs]}
        for lp in logprobs
    ]


def _error(e: TandemError, address: str, client: TandemClient) -> int:
    unreachable = e.code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in e.message
    # A --timeout shorter than the retries ends DEADLINE_EXCEEDED, whatever the attempts met.
    if unreachable or (e.code == grpc.StatusCode.DEADLINE_EXCEEDED and not client.reachable(0.5)):
        print(f"error: no tandem server at {address} ({e}); start one with `tandem up`", file=sys.stderr)
        return 1
    print(f"error: {e}", file=sys.stderr)
    return 2 if e.code == grpc.StatusCode.INVALID_ARGUMENT else 1


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
            tls_server_name=getattr(args, "tls_server_name", None),
            retries=getattr(args, "retries", DEFAULT_RETRIES),
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
            streams = [client.generate(p, **sampling) for p in prompts]
        except TypeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        try:
            for stream in streams:
                try:
                    if args.json:
                        builder = CompletionBuilder()
                        for item in stream:
                            builder.add(item)
                    else:
                        builder = _print_streaming(stream, out)
                except TandemError as e:
                    status = status or _error(e, address, client)
                    if e.code == grpc.StatusCode.UNAVAILABLE:
                        break
                    continue
                completion = builder.build()
                if args.json:
                    line = completion.to_json()
                    if completion.logprobs is not None:
                        line["logprobs"] = _logprobs_json(completion.logprobs)
                    print(json.dumps(line), flush=True)
                if completion.finish_reason == "abort":
                    print("error: the server aborted the request", file=sys.stderr)
                    status = status or 1
        except KeyboardInterrupt:
            out.write("\n")
            status = 130
        finally:
            for stream in streams:
                if stream.final is None:
                    stream.cancel()
    return status
