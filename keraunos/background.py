"""Every job keraunos runs off the user's thread goes through one queue, on one thread.

What may run here, and why that is safe: a job reads and writes keraunos's own objects (traces,
proxies, snapshots the user's thread took for it), files of keraunos's store, and pipes to its
helper processes. It never touches what the user's thread sees: no user module or tensor (the
user's thread snapshots what a job needs before submitting it), no ``warnings.warn`` or
``warnings.catch_warnings`` (the filters are one process-wide list the user's thread may be
swapping; ``compiler.kept_warnings`` keeps a job's messages for the user's thread), no torch
flags, configs, modes or class dictionaries, and no import of torch's compiler stack (two
threads importing Dynamo's circle of modules at once can meet one half initialized). Whatever
must touch those (loading a fused tier's kernels, generating its code) is left for the user's
thread at a call boundary (``runtime/tiers.py``).

Jobs run one at a time, by priority (lower first), then oldest first. A job belongs to an owner
(a jitted callable's state): ``cancel(owner)`` drops its jobs that have not started, and a job
holds its owner only weakly, so that deleting a jitted callable frees it and cancels its jobs.
At exit, fused-tier jobs not started are dropped and the one under way ends with the helper
processes (killed first); jobs that keep a program for later processes get a bounded time to
finish (``Queue.stop``). The thread is a daemon: past that bound the process does not wait.
"""
from __future__ import annotations

import atexit
import heapq
import itertools
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

# Priorities: a fused tier first (the program runs faster once it is there), then what is kept
# for later processes.
FUSED_TIER = 0
KEEP = 1

EXIT_KEEP_S = 30.0  # how long an exiting process gives the jobs of priority KEEP to finish


@dataclass(order=True)
class Job:
    priority: int
    number: int
    run: Callable[[], None] = field(compare=False)
    owner: object = field(compare=False, default=None)  # a weak reference, or None
    cancelled: bool = field(compare=False, default=False)
    done: threading.Event = field(compare=False, default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled = True


class Queue:
    """The one thread, and the jobs waiting for it."""

    def __init__(self, name: str = "keraunos-background"):
        self.name = name
        self._heap: list[Job] = []
        self._numbers = itertools.count()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.running: Job | None = None

    def submit(self, run: Callable[[], None], priority: int = FUSED_TIER,
               owner: object = None) -> Job:
        """Queue ``run()``; ``owner`` (held weakly) lets ``cancel`` drop it."""
        job = Job(priority, next(self._numbers), run)
        if owner is not None:
            # The owner's going cancels the job, on the thread that dropped it: this thread
            # never takes a reference to the owner, not even a passing one (dropping the last
            # would free the user's objects here, running their finalizers off the user's thread).
            job.owner = weakref.ref(owner, lambda _, job=job: job.cancel())
        with self._changed:
            if self._stopping and priority < KEEP:
                job.cancelled = True
                job.done.set()
                return job
            heapq.heappush(self._heap, job)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.keraunos_background = True  # (``core.lint`` asks)
                self._thread.start()
            self._changed.notify()
        return job

    def cancel(self, owner: object) -> int:
        """Drop the jobs of ``owner`` not started yet; how many."""
        return self._cancel_where(lambda job: job.owner is not None and job.owner() is owner)

    def _cancel_where(self, matches) -> int:
        with self._changed:
            dropped = [job for job in self._heap if matches(job)]
            for job in dropped:
                job.cancel()
            self._heap = [job for job in self._heap if not job.cancelled]
            heapq.heapify(self._heap)
        for job in dropped:
            job.done.set()
        return len(dropped)

    def pending(self) -> int:
        with self._changed:
            return len(self._heap) + (self.running is not None)

    def _serve(self) -> None:
        while True:
            with self._changed:
                while not self._heap and not self._stopping:
                    self._changed.wait()
                if not self._heap:  # stopping, and nothing left to keep
                    return
                job = heapq.heappop(self._heap)
                self.running = job
            try:
                if not job.cancelled:  # nor is it, when its owner is gone (``submit``)
                    job.run()
            except BaseException:  # noqa: BLE001 - a job reports its own failures
                pass
            finally:
                with self._changed:
                    self.running = None
                    self._changed.notify_all()
                job.done.set()

    def stop(self, keep_for: float = EXIT_KEEP_S) -> None:
        """At exit: drop every fused-tier job not started (the helpers are gone by then, so the
        one under way ends), and give the jobs that keep something for later processes up to
        ``keep_for`` seconds to finish (a kept program is pickled in well under a second; the
        store writes whole rows, so one cut short leaves nothing)."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        self._cancel_where(lambda job: job.priority < KEEP)
        deadline = time.monotonic() + keep_for
        with self._changed:
            while (self._heap or self.running is not None) and self._thread is not None \
                    and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)


_queue = Queue()
atexit.register(_queue.stop)


def submit(run: Callable[[], None], priority: int = FUSED_TIER, owner: object = None) -> Job:
    return _queue.submit(run, priority, owner)


def cancel(owner: object) -> int:
    return _queue.cancel(owner)


def pending() -> int:
    """Jobs queued or running."""
    return _queue.pending()


def stopping() -> bool:
    return _queue._stopping
