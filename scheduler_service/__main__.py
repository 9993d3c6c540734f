"""`python -m scheduler_service [scheduler] [flags]`: the same as `tandem scheduler [flags]`."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from scheduler_service import cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scheduler_service", description=cli.DESCRIPTION)
    parser.add_argument(
        "--log-level",
        default=os.environ.get("TANDEM_LOG_LEVEL", "INFO"),
        help="logging level [TANDEM_LOG_LEVEL]",
    )
    cli.add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["scheduler"]:
        argv = argv[1:]
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
