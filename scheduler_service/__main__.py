"""`python -m scheduler_service [scheduler] [flags]`: the same as `tandem scheduler [flags]`."""

import sys

from client.cli import service_main

if __name__ == "__main__":
    sys.exit(service_main("scheduler"))
