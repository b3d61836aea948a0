"""Tiered compilation: eager's kernels at once, the fused program from the background.

``keraunos.jit(model)`` fuses by default without making the first call wait for Inductor. On a
cache miss whose program is worth fusing (``worth_fusing``), the entry is compiled twice from
one capture:

- **tier 0**, on the calling thread: the passes and the autograd split as always, then the
  executor claims *without* the fusion executors. Every op runs eager's kernel; nothing of
  Inductor runs (or is even imported) on this thread, so the first call costs what the torch
  executor's costs. (Inductor's one-time set-up, its probe of the vector instructions, starts
  with the worker, on a thread of its own: ``warming.start_warming``.)
- **tier 1**, on one background thread (``_Worker``): the same traces claimed *with* the fusion
  executors, their regions compiled by Inductor (its own worker processes build the C++
  kernels, so g++ uses every core), and code generation. When it is done, ``switch`` makes the
  entry call the fused program from then on.

The switch is one attribute assignment (``entry.computation_fn``), and the call path reads that
attribute once per call: a call runs one whole program, the old or the new, whatever other
threads do. A computation with a backward is a ``torch.autograd.Function`` whose forward and
backward were made together, so a forward that ran on tier 0 runs its backward on tier 0 even
when the switch comes in between. Both tiers come from the same traces: the prologue (its
checks), the epilogue, the saved tensors of the autograd split and the order of random draws are
shared; regions never hold random ops (``regions.fusible``), so both tiers draw eager's values
from eager's generator in eager's order.

How fusion is compiled (``jit(..., fuse=...)``, default from ``KERAUNOS_FUSE``, else
``"background"``):

- ``"background"``: as above.
- ``"wait"``: the first call compiles the fused program itself and runs it (no tier 0). Also what
  ``"background"`` does while ``torch.use_deterministic_algorithms(True)`` is on: a run that
  asks for determinism gets the same kernels on every call.
- ``"off"``: no fusion: the fusion executors are dropped from the list.

A process that exits while a fused program is being compiled does not wait for it: the worker is
a daemon thread, jobs not started are dropped at exit, and Inductor writes its caches by
renaming finished files (nothing half-written is ever read back).
"""
from __future__ import annotations

import atexit
import contextlib
import enum
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .executors.base import IMPORT_LOCK


class FuseMode(enum.Enum):
    """How the fused program of an entry is compiled (``keraunos.jit(..., fuse=...)``)."""

    BACKGROUND = "background"  # tier 0 at once, the fused tier when it is ready
    WAIT = "wait"              # the first call waits for the fused program
    OFF = "off"                # no fusion


def default_mode() -> str:
    return os.environ.get("KERAUNOS_FUSE", "").strip() or FuseMode.BACKGROUND.value


# A program is fused only when some trace of it (forward or backward) has at least this many
# lines that a region would compute (pointwise ops, reductions, norms; not views, not the matrix
# products Inductor hands to the same BLAS calls eager makes). Below it, the Python saved by a
# region call does not pay for a compile of seconds: a one-op function, ``(x * 2 + 1).relu()``.
MIN_FUSED_OPS = 6

def worth_fusing(traces, computes: Callable, min_ops: int | None = None) -> bool:
    """Whether some trace has at least ``min_ops`` (default ``MIN_FUSED_OPS``) lines for which
    ``computes(line)`` (the fusion executor's ``fusion.computes_in_region``)."""
    min_ops = MIN_FUSED_OPS if min_ops is None else min_ops
    for trace in traces:
        if trace is None:
            continue
        count = 0
        for b in trace.bound_symbols:
            if computes(b):
                count += 1
                if count >= min_ops:
                    return True
    return False


@dataclass
class Tiering:
    """An entry's fused tier, while it compiles and after (``compile_stats``)."""

    mode: FuseMode
    tier: str = "torch"                  # what the entry runs now: "torch" or "fused"
    done: threading.Event = field(default_factory=threading.Event)
    started_at: float = field(default_factory=time.perf_counter)
    seconds: float | None = None         # the fused compile's wall time, once done
    fused_from_call: int | None = None   # calls of the callable before the switch
    error: BaseException | None = None   # the fused compile failed: tier 0 stays
    stages: dict = field(default_factory=dict)
    # Weak references to entries of identical FSDP2 units rebound from this one
    # (pipeline.rebind_entry): the switch to the fused tier switches them too.
    followers: list = field(default_factory=list)

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)


class _Worker:
    """One daemon thread compiling fused tiers, one job at a time, oldest first. One thread: the
    compiles' Python (lowering, code generation) shares the interpreter with the caller's calls,
    and two at once would only take turns; Inductor's compile workers build the kernels in
    parallel processes."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.stopping = False
        self.busy = False  # a job (or Inductor's first import) is running

    def submit(self, job: Callable[[], None]) -> None:
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="keraunos-fusion",
                                               daemon=True)
                self.thread.start()
        self.jobs.put(job)

    def _run(self) -> None:
        try:
            self.busy = True
            with IMPORT_LOCK:
                from .executors.fusion import warming
            warming.start_warming()  # the probe, on a thread of its own
            warming.wait_for_warming_imports()  # Inductor's modules, off the caller's thread
            _stop_before_executors_shut_down(self)
            while True:
                self.busy = False
                job = self.jobs.get()
                if self.stopping:
                    continue  # the process is exiting: jobs not started are dropped
                self.busy = True
                _keep_rng_state_off_the_worker()
                job()
        except _ProcessExiting:
            return  # stop() ended the compile under way: the thread ends before the interpreter
        finally:
            self.busy = False

    def stop(self) -> None:
        """At exit: drop the jobs not started and end the one under way.

        A daemon thread still running when the interpreter finalizes is ended by CPython (3.11 to
        3.13) with ``pthread_exit`` as soon as it next takes the GIL. If that happens as a torch
        C++ function that released the GIL takes it back, the unwinding meets a ``noexcept``
        frame and the whole process aborts ("terminate called without an active exception",
        status 134; 2 exits in 30 on a loaded machine). So a compile under way is interrupted
        here, while the interpreter is whole: ``_ProcessExiting`` is raised in the worker at its
        next Python line, and the worker ends. A worker blocked in plain C (waiting for g++ or
        for Inductor's compile processes) cannot take the exception until that returns; after
        ``EXIT_GRACE_S`` the process exits anyway, as before. How the exception is raised so that
        it ends the worker and nothing else: ``_interrupt``."""
        self.stopping = True
        thread = self.thread
        if thread is None or not thread.is_alive() or not self.busy:
            return
        _interrupt(thread, EXIT_GRACE_S)


def _interrupt(thread: threading.Thread, grace: float) -> None:
    """Raise ``_ProcessExiting`` in ``thread`` and wait up to ``grace`` seconds for it to end.

    An exception raised from outside lands at the thread's next check (in the frame it runs,
    or at the entry of the next function called), and two kinds of places cannot take it.
    The import machinery's locks: raised as a module lock is taken or given back (or the
    import lock in its weakref callback), it leaves the lock held, and the next import of
    another thread (the exiting main thread's, Inductor's compile threads') waits forever. So it
    is sent only while the thread runs none of the functions that handle those locks
    (``_holds_import_locks``); elsewhere in an import it fails the import as any error there
    does, which importlib undoes. And callbacks (a weakref's, a ``__del__``): what they raise
    is printed ("Exception ignored in ...") and dropped, and the thread goes on compiling. Such
    a drop is caught on the thread (``sys.unraisablehook``), not printed, and the exception
    raised again from a trace function, at the next line the thread runs outside those
    functions (an exception sent from the hook would land in the hook)."""
    import ctypes
    ident = ctypes.c_ulong(thread.ident)
    previous = sys.unraisablehook

    def again(frame, event, arg):
        if _holds_import_locks(frame.f_code):
            return None  # not this frame: the next line of a frame that called it
        raise _ProcessExiting  # (the thread's tracing ends with it)

    def hook(unraisable) -> None:
        if unraisable.exc_type is not _ProcessExiting or threading.current_thread() is not thread:
            previous(unraisable)
            return
        sys.settrace(again)  # for the frames called from now on
        frame = sys._getframe(1)  # the frames under way: the one the callback interrupted, up
        while frame is not None:
            frame.f_trace = again
            frame = frame.f_back
    sys.unraisablehook = hook
    deadline = time.monotonic() + grace
    sent = False
    while not sent and thread.is_alive() and time.monotonic() < deadline:
        if not _holds_import_locks(_running(thread)):
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ident, ctypes.py_object(_ProcessExiting))
            sent = True
            if _holds_import_locks(_running(thread)):  # it ran in between, into one of them:
                # take the exception back (PyThreadState_SetAsyncExc with NULL), send it later
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ident, None)
                sent = False
        if not sent:
            time.sleep(0.001)
    thread.join(max(0.0, deadline - time.monotonic()))
    if not thread.is_alive() and sys.unraisablehook is hook:
        sys.unraisablehook = previous


def _running(thread: threading.Thread):
    """The code of the Python frame ``thread`` runs (or whose C call it is in), or None."""
    frame = sys._current_frames().get(thread.ident)
    return frame.f_code if frame is not None else None


# The functions of importlib (3.11 to 3.13) that take or give back the import lock or a module
# lock, or call what does (``_find_and_load``'s ``with`` gives its module's lock back).
_IMPORT_LOCK_FUNCTIONS = frozenset({
    "_find_and_load", "_get_module_lock", "cb", "_lock_unlock_module", "acquire", "release",
    "__enter__", "__exit__", "has_deadlock", "_has_deadlocked", "_blocking_on"})


def _holds_import_locks(code) -> bool:
    return code is not None and code.co_filename == "<frozen importlib._bootstrap>" \
        and code.co_name in _IMPORT_LOCK_FUNCTIONS


class _ProcessExiting(BaseException):
    """Raised in the worker by ``_Worker.stop`` to end a compile when the process exits. Not an
    ``Exception``: the compile's own handlers (``schedule``'s, Inductor's) must not absorb it."""


# How long an exiting process waits for the worker to leave a compile (it normally takes
# milliseconds: the next Python line of the compile).
EXIT_GRACE_S = 2.0


def _on_worker() -> bool:
    return threading.current_thread() is _worker.thread


# torch's modules that bind ``preserve_rng_state`` by name (compile_fx and codegen/wrapper look it
# up on ``torch._dynamo.utils`` at each call).
_RNG_PRESERVERS = ("torch._dynamo.utils", "torch._functorch.aot_autograd",
                   "torch._inductor.select_algorithm", "torch._inductor.cudagraph_trees",
                   "torch._inductor.codegen.triton")


def _keep_rng_state_off_the_worker() -> None:
    """Make ``torch._dynamo.utils.preserve_rng_state()`` do nothing on the worker thread.

    The generators are global to the process, and Inductor and AOTAutograd compile under
    ``preserve_rng_state()``: it saves the generators' states when a compile starts and sets them
    back when it ends. On the worker, that would rewind the caller's generator to where it was
    when the compile began, undoing the ``torch.manual_seed`` and the draws of the calls made
    meanwhile (the fuzzer's 2000:486: eager's inputs, drawn after a seed, came out different).
    A compile on the worker draws nothing, so there is nothing to set back; every other thread
    gets torch's own. Called before each job: the modules are imported on first use."""
    for module_name in _RNG_PRESERVERS:
        module = sys.modules.get(module_name)
        original = getattr(module, "preserve_rng_state", None)
        if original is None or getattr(original, "_keraunos_worker_guard", False):
            continue

        @contextlib.contextmanager
        def preserve_rng_state(_original=original):
            if _on_worker():
                yield
            else:
                with _original():
                    yield
        preserve_rng_state._keraunos_worker_guard = True
        preserve_rng_state.__wrapped__ = original
        module.preserve_rng_state = preserve_rng_state


def _stop_before_executors_shut_down(worker: _Worker) -> None:
    """Have ``worker.stop`` run first when the process exits.

    ``threading._register_atexit`` hooks run newest first as the main thread ends, before
    ``atexit``'s handlers; concurrent.futures shuts its executors down from there (Inductor's
    compile pool among them), and a compile still under way would then fail ("cannot schedule new
    futures after interpreter shutdown") and warn about it. Registered once Inductor is imported,
    so after concurrent.futures' own hooks; ``atexit`` (below) stays where the private hook is
    missing."""
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        with contextlib.suppress(RuntimeError):  # the process is already exiting
            register(worker.stop)


_worker = _Worker()
atexit.register(_worker.stop)


def _fx_tracing_seen_per_thread() -> None:
    """Make torch.fx's "is a symbolic trace under way" a question about the calling thread.

    torch.fx marks a trace with one module global (``_is_fx_tracing_flag``), and every function
    ``torch.compile`` wraps checks it on each call: a compiled function called while a trace is
    under way raises ("Detected that you are using FX to symbolically trace a dynamo-optimized
    function"). A fused compile on the worker traces (AOTAutograd's ``make_fx``, Inductor's
    pattern matcher) for most of its seconds, so any ``torch.compile``d function, the user's own
    or keraunos's fallback route, called meanwhile on another thread raised. Here the traces
    started through ``Tracer.trace`` are counted per thread, and the check answers for the
    caller's thread: a trace elsewhere is not the caller's. A flag set some other way (nobody
    counted tracing) keeps torch's answer. Applied at import: ``torch.compile`` binds the check
    when it wraps a function."""
    from torch.fx import _symbolic_trace as fx_trace
    if getattr(fx_trace.is_fx_symbolic_tracing, "_keraunos_per_thread", False):
        return
    tracing: dict[int, int] = {}  # thread ident -> traces under way on it
    original_trace = fx_trace.Tracer.trace
    original_check = fx_trace.is_fx_symbolic_tracing

    def trace(self, *args, **kwargs):
        me = threading.get_ident()
        tracing[me] = tracing.get(me, 0) + 1
        try:
            return original_trace(self, *args, **kwargs)
        finally:
            if tracing[me] == 1:
                del tracing[me]
            else:
                tracing[me] -= 1

    def is_fx_symbolic_tracing() -> bool:
        return original_check() and (not tracing or threading.get_ident() in tracing)

    trace.__wrapped__ = original_trace
    is_fx_symbolic_tracing.__wrapped__ = original_check
    is_fx_symbolic_tracing._keraunos_per_thread = True
    fx_trace.Tracer.trace = trace
    fx_trace.is_fx_symbolic_tracing = is_fx_symbolic_tracing


_fx_tracing_seen_per_thread()


def exiting() -> bool:
    """The process is exiting: what fails in a fused compile now fails for that reason."""
    return _worker.stopping or sys.is_finalizing()



def schedule(tiering: Tiering, compile_fused: Callable[[], Callable], switch: Callable) -> None:
    """Compile ``compile_fused()`` on the worker; ``switch(result)`` when it returns. A failure
    leaves tier 0 in place (``tiering.error``; warned once per cause)."""
    grad_mode = torch.is_grad_enabled()  # thread-local: the worker compiles in the caller's

    def job():
        try:
            with torch.set_grad_enabled(grad_mode):
                made = compile_fused()
            switch(made)
        except Exception as e:  # noqa: BLE001 - the torch tier keeps running
            tiering.error = e
            from .executors.fusion.compiler import warn_once
            warn_once(f"keraunos: the fused program could not be compiled "
                      f"({type(e).__name__}: {e}); the torch executor keeps running it.")
        finally:
            tiering.seconds = time.perf_counter() - tiering.started_at
            tiering.done.set()
    _worker.submit(job)


def pending(entries) -> list[Tiering]:
    return [t for e in entries if (t := getattr(e, "tiering", None)) is not None
            and not t.done.is_set()]


def wait_for_fusion(state, timeout: float | None = None) -> bool:
    """Wait until every entry of ``state`` runs its final tier; False if ``timeout`` passed."""
    deadline = None if timeout is None else time.perf_counter() + timeout
    for t in pending(state.entries):
        left = None if deadline is None else max(0.0, deadline - time.perf_counter())
        if not t.wait(left):
            return False
    return True
