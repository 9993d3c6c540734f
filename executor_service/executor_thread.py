"""The executor's own thread: every call into the executor (loading included) runs on it, one at
a time, in the order the calls were made.

torch's OpenMP thread team belongs to the calling thread, and gRPC worker threads taking turns
would each start a team of their own, all spinning on the same cores (a 5x slower step on 2
cores, measured with bench/throughput.py). A call is handed over in one queue put and answered
through one lock release: about 45 us of CPU and 60 us of wall time a round trip on a 2-core CPU,
against about 67 and 79 through a one-thread ThreadPoolExecutor's submit().result()."""

from __future__ import annotations

import _thread
import queue
import threading
import weakref
from concurrent.futures import Future


class _Call:
    __slots__ = ("args", "done", "error", "fn", "future", "result")

    def __init__(self, fn, args: tuple, done: _thread.LockType | None, future: Future | None) -> None:
        self.fn, self.args, self.done, self.future = fn, args, done, future
        self.result = self.error = None


class ExecutorThread:
    """One thread that runs the calls given to it, in order. It is a daemon: the service waits for
    it where it must (its close runs on it); it ends once this object is garbage."""

    def __init__(self, name: str = "executor-step") -> None:
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        weakref.finalize(self, self._calls.put, None)
        threading.Thread(target=_serve, args=(self._calls,), name=name, daemon=True).start()

    def run(self, fn, *args):
        """fn(*args) on the thread; returns its result or raises its exception."""
        done = _thread.allocate_lock()
        done.acquire()
        call = _Call(fn, args, done, None)
        self._calls.put(call)
        done.acquire()
        result, error = call.result, call.error
        call = None  # the exception's traceback holds this frame: no cycle through the call
        if error is not None:
            raise error
        return result

    def submit(self, fn, *args) -> Future:
        """fn(*args) on the thread, without waiting for it: its Future."""
        future: Future = Future()
        self._calls.put(_Call(fn, args, None, future))
        return future


def _serve(calls: queue.SimpleQueue[_Call | None]) -> None:
    while (call := calls.get()) is not None:
        if call.future is not None:
            if call.future.set_running_or_notify_cancel():
                try:
                    call.future.set_result(call.fn(*call.args))
                except BaseException as e:
                    call.future.set_exception(e)
            continue
        try:
            call.result = call.fn(*call.args)
        except BaseException as e:
            call.error = e
        call.done.release()
        call = None
