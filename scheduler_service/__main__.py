"""`python -m scheduler_service [scheduler] [flags]`: the same as `tandem scheduler [flags]`."""

import sys

from protos.service_main import service_main
from scheduler_service.cli import add_parser

if __name__ == "__main__":
    sys.exit(service_main("scheduler", add_parser))
