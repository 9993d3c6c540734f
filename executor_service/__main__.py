"""`python -m executor_service [executor] [flags]`: the same as `tandem executor [flags]`."""

import sys

from client.cli import service_main

if __name__ == "__main__":
    sys.exit(service_main("executor"))
