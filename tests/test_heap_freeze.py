"""protos/service_main.freeze_startup_heap: a service process freezes its start-up heap once it
serves (so Python's full collections skip it); inside another program (the in-process LLM, a test
run) it does nothing, since frozen objects that later become cyclic garbage are never freed."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_outside_a_service_process_nothing_is_frozen():
    from protos.service_main import freeze_startup_heap

    before = gc.get_freeze_count()
    freeze_startup_heap()
    assert gc.get_freeze_count() == before


def test_a_service_process_freezes_what_it_built_and_frees_later_cycles():
    script = (
        "import gc, weakref\n"
        "from protos.service_main import freeze_startup_heap, mark_service_process\n"
        "class Node: pass\n"
        "kept = [Node() for _ in range(1000)]\n"
        "mark_service_process()\n"
        "freeze_startup_heap()\n"
        "assert gc.get_freeze_count() >= 1000, gc.get_freeze_count()\n"
        "later = Node(); later.me = later; ref = weakref.ref(later); del later\n"
        "gc.collect()\n"
        "assert ref() is None  # a cycle made after the freeze is still collected\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
