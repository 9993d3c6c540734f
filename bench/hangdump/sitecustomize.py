"""On PYTHONPATH (bench/gpu_run.sh puts it there for the tensor-parallel stages), every Python
process, the TP ranks included, prints all its threads' stacks to stderr each TANDEM_STACK_DUMP_S
seconds: where a hung collective waits shows in the stage's log before the stage's time limit."""

import faulthandler
import os

_every = os.environ.get("TANDEM_STACK_DUMP_S")
if _every:
    faulthandler.dump_traceback_later(float(_every), repeat=True)
