"""`python -m executor_service [executor] [flags]`: the same as `tandem executor [flags]`."""

import sys

from executor_service.cli import add_parser
from protos.service_main import service_main

if __name__ == "__main__":
    sys.exit(service_main("executor", add_parser))
