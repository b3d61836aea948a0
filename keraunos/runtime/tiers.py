"""Tiered compilation: eager's kernels at once, the fused program from helper processes.

``keraunos.jit(model)`` fuses by default without making the first call wait for Inductor. On a
cache miss whose program is worth fusing (``worth_fusing``), the entry is compiled twice from
one capture:

- **tier 0**, on the calling thread: the passes and the autograd split as always, then the
  executor claims *without* the fusion executors. Every op runs eager's kernel; nothing of
  Inductor runs (or is even imported) in this process, so the first call costs what the torch
  executor's costs.
- **tier 1**, the fused program. On keraunos's background thread (``background.py``), the
  same traces are claimed *with* the fusion executors and their regions formed; each distinct
  region is described (its FX graph's nodes, its inputs' metadata, the settings Inductor keys
  on, read on the user's thread when the compile was asked for: ``compiler.CompileSite``) and
  compiled by a helper process (``executors/fusion/workers.py``), which hands back Inductor's
  generated module. That thread touches keraunos's own objects only. When every region is
  compiled, the entry's ``computation_fn`` becomes a *switch*: the next call, on the user's
  thread, loads the modules (as a restart loads regions from the store), generates the fused
  tier's code, makes it the entry's program, and runs it. ``wait_for_fusion`` makes the switch
  on the calling thread.

A call runs one whole program, the old or the new: the switch is made before the computation
starts. A computation with a backward is a ``torch.autograd.Function`` whose forward and
backward were made together, so a forward that ran on tier 0 runs its backward on tier 0 even
when the switch comes in between. Both tiers come from the same traces: the prologue (its
checks), the epilogue, the saved tensors of the autograd split and the order of random draws are
shared; regions never hold random ops (``regions.fusible``), so both tiers draw eager's values
from eager's generator in eager's order.

Regions the helpers do not compile (symbolic sizes, not the CPU, a graph whose generated module
alone does not reproduce it) run on the torch executor in the fused tier; ``fuse="wait"``
compiles them in this process, on the calling thread.

How fusion is compiled (``jit(..., fuse=...)``, default from ``KERAUNOS_FUSE``, else
``"background"``):

- ``"background"``: as above.
- ``"wait"``: the first call compiles the fused program itself, on its own thread, and runs it
  (no tier 0). Also what ``"background"`` does while ``torch.use_deterministic_algorithms(True)``
  is on: a run that asks for determinism gets the same kernels on every call.
- ``"off"``: no fusion: the fusion executors are dropped from the list.

A process that exits while a fused program is being compiled does not wait for it: the job
waits on a pipe to a helper, the helpers are killed at exit, and nothing is written but whole
files (the store writes by renaming finished files).
"""
from __future__ import annotations

import enum
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import background


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
    compiled: threading.Event = field(default_factory=threading.Event)  # the background's part
    done: threading.Event = field(default_factory=threading.Event)  # switched, or failed
    started_at: float = field(default_factory=time.perf_counter)
    seconds: float | None = None         # until the switch (or the failure)
    fused_from_call: int | None = None   # calls of the callable before the switch
    error: BaseException | None = None   # the fused compile failed: tier 0 stays
    stages: dict = field(default_factory=dict)
    # Weak references to entries of identical FSDP2 units rebound from this one
    # (pipeline.rebind_entry): the switch to the fused tier switches them too.
    followers: list = field(default_factory=list)
    finish: Callable[[], None] | None = None  # the switch, to be made on the user's thread
    # After the switch (made or not): the entry's calls stop looking for it (tier 0 for good
    # where it was not made).
    give_up: Callable[[], None] | None = None
    job: object = None                   # background.Job
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def switch_now(self) -> None:
        """Make the switch (or give up on it) on the calling thread, the user's: once."""
        with self._lock:
            finish, self.finish = self.finish, None
            if finish is None:
                return
            try:
                finish()
            except Exception as e:  # noqa: BLE001 - the torch tier keeps running
                self.error = e
                _warn(f"keraunos: the fused program could not be loaded "
                      f"({type(e).__name__}: {e}); the torch executor keeps running it.")
            finally:
                if self.give_up is not None:  # switched or not, the look for it goes
                    self.give_up()
                self.seconds = time.perf_counter() - self.started_at
                self.done.set()


def _warn(message: str) -> None:
    from ..executors.fusion.compiler import warn_once
    warn_once(message)


def schedule(tiering: Tiering, compile_fused: Callable[[], object],
             switch: Callable[[object], Callable], entry, owner) -> None:
    """Run ``compile_fused()`` in the background; once it returns, the entry's next call (or
    ``wait_for_fusion``) calls ``switch(result)`` on the user's thread, which makes the fused
    tier the entry's program. A failure leaves tier 0 in place (``tiering.error``; warned once
    per cause, on the user's thread). The job holds neither the entry (whose prologue holds the
    user's module: the last reference to it must never be dropped on the background thread)
    nor ``owner``, the jitted callable's state, which it holds weakly: deleting the callable
    cancels the job. It sets ``tiering.finish``, which the entry's calls look for
    (``_switch_at_next_call``), and nothing else."""
    grad_mode = torch.is_grad_enabled()  # thread-local: the job compiles in the caller's
    _switch_at_next_call(entry, tiering)

    def job():
        from ..executors.fusion.compiler import kept_warnings
        with kept_warnings() as messages:
            try:
                with torch.set_grad_enabled(grad_mode):
                    made = compile_fused()
            except Exception as e:  # noqa: BLE001 - the torch tier keeps running
                made, failure = None, e
            else:
                failure = None

        def finish():
            for message in messages:  # what the compile had to say, said on the user's thread
                _warn(message)
            if failure is not None:
                raise failure
            switch(made)
        tiering.finish = finish
        tiering.compiled.set()
    tiering.job = background.submit(job, background.FUSED_TIER, owner)


def _switch_at_next_call(entry, tiering: Tiering) -> None:
    """The entry's ``computation_fn`` (read once per call, by the Python and the native hit
    path) becomes tier 0's behind a look at ``tiering.finish``: the first call after the
    background set it makes the switch, on the calling thread, before its computation runs,
    and runs the new tier. Until then a call costs one Python frame more than tier 0's."""
    running = entry.computation_fn
    entry_ref = weakref.ref(entry)

    def back_to_tier_zero() -> None:  # not switched: tier 0 for good, without this frame
        kept = entry_ref()
        if kept is not None and kept.computation_fn is tier_zero:
            kept.computation_fn = running

    def tier_zero(*inputs):
        if tiering.finish is None:
            return running(*inputs)
        tiering.switch_now()
        kept = entry_ref()
        return (running if kept is None else kept.computation_fn)(*inputs)
    tiering.give_up = back_to_tier_zero
    entry.computation_fn = tier_zero


def pending(entries) -> list[Tiering]:
    return [t for e in entries if (t := getattr(e, "tiering", None)) is not None
            and not t.done.is_set()]


def wait_for_fusion(state, timeout: float | None = None) -> bool:
    """Wait until every entry of ``state`` runs its final tier (the switch made here, on the
    calling thread); False if ``timeout`` passed."""
    deadline = None if timeout is None else time.perf_counter() + timeout
    for t in pending(state.entries):
        left = None if deadline is None else max(0.0, deadline - time.perf_counter())
        if not t.compiled.wait(left):
            return False
        t.switch_now()
    return True


def exiting() -> bool:
    """The process is exiting: what fails in a fused compile now fails for that reason."""
    import sys
    return background.stopping() or sys.is_finalizing()
