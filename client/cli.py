"""The `tandem` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def _env(name: str, default=None):
    return os.environ.get(f"TANDEM_{name}", default)


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids takes comma-separated integers, got {text!r}"
        ) from None


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", default=_env("MODEL"), help="checkpoint directory: run in-process")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", help="prompt text (repeat for several prompts)")
    prompt.add_argument("--prompt-ids", type=_token_ids, action="append", help="prompt as token ids: 1,2,3")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens to generate at most (default 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--seed", type=int, default=None, help="per-request seed for reproducible sampling")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--device", default=_env("DEVICE", "cpu"), help="cpu or cuda (in-process)")
    p.add_argument("--dtype", default=_env("DTYPE"), help="weights dtype (default: the checkpoint's)")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from scheduler_service.llm import LLM
    from scheduler_service.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
        llm = LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len)
        prompts = args.prompt if args.prompt is not None else args.prompt_ids
        outputs = llm.generate(prompts, params, use_tqdm=False)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for out in outputs:
        if args.json:
            print(
                json.dumps({"token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason})
            )
        else:
            print(out.text if out.text is not None else " ".join(map(str, out.token_ids)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tandem", description="LLM serving: a CPU scheduler and a GPU executor"
    )
    parser.add_argument("--log-level", default=_env("LOG_LEVEL", "WARNING"), help="logging level")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
