"""Region compiles spread over every core: helper processes that warm Inductor's caches ahead.

A cold fused compile spends most of its time in Inductor's Python (lowering, scheduling, C++ code
generation: about a second a distinct region here), which one interpreter runs one region at a
time whatever the cores. So when a trace has several distinct regions to compile, their graphs
go to helper processes first (``prefetch``), and the compiling thread then takes the regions in
order:

- a region no helper has started yet is taken back and compiled in this process, as always
  (``claim`` returns None): the thread never waits for a helper that is still starting up or busy
  with another region, so a compile is never slower than without helpers by more than the
  hand-over;
- a region a helper is compiling is waited for; its compile filled Inductor's caches (the FX
  graph cache, the built C++ kernels) in the shared cache directory, and this process's own
  ``compile_fx`` of the same graph is then a cache hit (a quarter of a second instead of seconds).

The helpers only ever warm caches: what the program runs is compiled (from the cache) and checked
here exactly as without them, so a helper that fails, dies or compiles something else changes
nothing but the time. Only regions of static sizes on the CPU whose graph pickles are sent (the
ones ``kernel_store`` keeps); everything a compile reads besides the graph (threads, default dtype,
determinism, matmul precision, oneDNN, Inductor's config, the region's layout choice) is sent
with it, so that the helper's cache key is this process's.

How many helpers: ``KERAUNOS_COMPILE_WORKERS`` (0: none for compiles in this process; a fused tier
compiled in the background still gets one, its only place to compile); by default one fewer than
the cores, at least one, at most 8, and no help for compiles in this process while the load average
says the cores are taken. They start with the
first region sent to them (``prefetch``) and are killed when the process exits (``stop``; a
helper whose parent died reads the end of its input and exits).
"""
from __future__ import annotations

import atexit
import contextlib
import io
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from ... import debug
from ...persist import store
from ...torch_internals.dispatch import OpOverload

ENV = "KERAUNOS_COMPILE_WORKERS"
IDLE_S = 60.0  # helpers idle this long are ended


def worker_count() -> int:
    value = os.environ.get(ENV, "").strip()
    if value:
        try:
            return max(0, int(value))
        except ValueError:
            raise ValueError(f"{ENV} must be a whole number of helper processes, not {value!r}")
    return max(0, min((os.cpu_count() or 1) - 1, 8))


@dataclass
class Job:
    key: str
    payload: bytes
    helper: "Helper | None" = None  # the helper compiling it; None while queued
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    row: bytes | None = None  # what the helper generated (``kernel_store.row``), when ok
    reason: str = "the helper process was lost"  # why not, when not ok
    # The background tier waits for it (``compile_elsewhere``): never taken back by ``claim``.
    needed_elsewhere: bool = False


def settings(inductor_config: dict | None = None) -> dict:
    """What besides the graph decides Inductor's code and cache key, as this process has it;
    ``inductor_config``: the entries of Inductor's config to set in the helper
    (``compiler.inductor_config_changes``; by default every entry, as this process has it)."""
    if inductor_config is None:
        from ...torch_internals.inductor import config
        inductor_config = config.save_config_portable()
    matmul = torch.backends.cuda.matmul
    return {"threads": torch.get_num_threads(), "default_dtype": torch.get_default_dtype(),
            "deterministic": (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled()),
            "fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,
            "matmul_precision": torch.get_float32_matmul_precision(),
            # what Inductor's FX graph cache keys on, which the setting above does not decide
            # alone: ``set_float32_matmul_precision("highest")`` turns it from "none" to "ieee"
            "cuda_matmul": (matmul.fp32_precision, matmul.allow_fp16_reduced_precision_reduction,
                            matmul.allow_bf16_reduced_precision_reduction),
            "mkldnn": torch.backends.mkldnn.enabled,
            "inductor_config": inductor_config}


def busy() -> bool:
    """The machine's cores are taken (the last minute's load average): helpers would only slow
    the compile down. Unknown where the system gives no load average; never where
    ``KERAUNOS_COMPILE_WORKERS`` sets the number of helpers (the user decided)."""
    if os.environ.get(ENV, "").strip():
        return False
    try:
        return os.getloadavg()[0] >= (os.cpu_count() or 1)
    except OSError:
        return False


def job_payload(graph, inputs, layout_choice, config_patches: dict,
                given: dict | None = None) -> bytes | None:
    """The pickled job for a static region's FX ``graph`` with inputs of the proxies' metadata
    and sharing; None when the graph does not pickle (a target that is no importable function).
    Made from keraunos's own objects only (no ``GraphModule``, whose making registers source
    in ``linecache``): it may be made off the user's thread."""
    from . import float_symbols
    metas = [(*float_symbols.STAND_IN[:3], "cpu") if float_symbols.is_float_symbol(p) else
             (tuple(p.shape), tuple(p.stride), p.dtype, str(p.device)) for p in inputs]
    first: dict = {}
    aliases = tuple(first.setdefault(p.storage, k) if getattr(p, "storage", None) is not None
                    else k for k, p in enumerate(inputs))
    try:
        buffer = io.BytesIO()
        _GraphPickler(buffer).dump((_nodes(graph), metas, aliases, layout_choice, config_patches,
                                    given if given is not None else settings()))
        return buffer.getvalue()
    except Exception:  # noqa: BLE001 - such a region is compiled in this process only
        return None


class _Ref:
    """A node of the graph, by name, in a pickled graph."""

    def __init__(self, name: str):
        self.name = name


def _op(name: str, overload: str):
    namespace, op = name.split("::")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def _torch_constant(name: str):
    return getattr(torch, name)


class _GraphPickler(pickle.Pickler):
    """Pickles a graph's nodes: each node an ``_Ref`` by name, each ATen operator by its name,
    each dtype, layout and memory format by its name in ``torch``. (Their own pickling names
    them by a dotted name that pickle looks for in whichever module holds ``torch``; in a process
    started by ``multiprocessing``'s spawn it finds none and names ``__main__``, where the
    helper process does not find it.)"""

    def reducer_override(self, obj):
        if isinstance(obj, torch.fx.Node):
            return _Ref, (obj.name,)
        if isinstance(obj, OpOverload):
            return _op, (obj._schema.name, obj._overloadname)
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            name = str(obj).removeprefix("torch.")
            if getattr(torch, name, None) is obj:
                return _torch_constant, (name,)
        return NotImplemented


def _nodes(graph) -> list:
    return [(n.op, n.name, n.target, n.args, n.kwargs) for n in graph.nodes]


_HELPER_MAIN = "from keraunos.executors.fusion import helper_process; helper_process.serve()"


class Helper:
    """One helper process and the thread reading its answers."""

    def __init__(self, pool: "Pool"):
        self.pool = pool
        env = {**os.environ, ENV: "0", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-c", _HELPER_MAIN],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        self.job: Job | None = None
        self.reader = threading.Thread(target=self._read, name="keraunos-compile-helper",
                                       daemon=True)
        self.reader.start()

    def send(self, job: Job) -> bool:
        self.job, job.helper = job, self
        try:
            _write(self.process.stdin, (job.key, job.payload))
            return True
        except (OSError, ValueError):  # the helper is gone
            return False

    def _read(self) -> None:
        try:
            while True:
                key, ok, row, reason = _read(self.process.stdout)
                self.pool.finished(self, key, ok, row, reason)
        except (EOFError, OSError, ValueError, pickle.UnpicklingError, struct.error):
            self.pool.lost(self)


class Pool:
    def __init__(self, size: int, helps_here: bool = True):
        self.size = size
        # Whether it also takes regions ahead of compiles in this process (``available``); a pool
        # for the background tier alone does not (``KERAUNOS_COMPILE_WORKERS=0``).
        self.helps_here = helps_here
        self.lock = threading.RLock()  # ``_dispatch`` may drop a helper it finds gone
        self.helpers: list[Helper] = []
        self.idle: list[Helper] = []
        self.queue: list[Job] = []
        self.jobs: dict[str, Job] = {}
        self.stopped = False
        self.spawned = 0  # helpers started, lost ones included: at most twice ``size``
        self.last_finished = 0.0

    def start(self) -> None:
        with self.lock:
            while (not self.stopped and len(self.helpers) < self.size
                   and self.spawned < 2 * self.size):
                try:
                    helper = Helper(self)
                except OSError:
                    self.size = len(self.helpers)
                    return
                self.spawned += 1
                self.helpers.append(helper)  # idle once it says it is ready (``finished``)

    def prefetch(self, key: str, payload: bytes, needed: bool = False) -> Job | None:
        with self.lock:
            if key in self.jobs:
                self.jobs[key].needed_elsewhere |= needed
                return self.jobs[key]
            if self.stopped or not self.helpers:
                return None
            job = Job(key, payload, needed_elsewhere=needed)
            self.jobs[key] = job
            self.queue.append(job)
            self._dispatch()
            return job

    def claim(self, key: str) -> Job | None:
        """The helper's job for ``key`` if one started it (wait for ``job.done``); None when no
        helper has (it is taken off the queue: this process compiles it)."""
        with self.lock:
            job = self.jobs.get(key)
            if job is None:
                return None
            if job.helper is None and not job.needed_elsewhere:
                self.queue.remove(job)
                del self.jobs[key]
                return None
            return job

    def _dispatch(self) -> None:
        """Helpers take the newest jobs first: the compiling thread takes the regions from the
        first on, so the two meet in the middle, and it waits only for the one being compiled
        when it gets there."""
        while self.queue and self.idle:
            job, helper = self.queue.pop(), self.idle.pop(0)
            if not helper.send(job):
                job.helper = None
                self.queue.append(job)
                self.lost(helper)  # (re-entrant lock: see ``Pool.__init__``)

    def finished(self, helper: Helper, key: str | None, ok: bool, row: bytes | None = None,
                 reason: str = "") -> None:
        """``helper`` compiled ``key`` (``ok``: without an error); a key of None: it is ready for
        its first job, torch and Inductor imported."""
        with self.lock:
            job = self.jobs.pop(key, None) if key is not None else None
            helper.job = None
            self.idle.append(helper)
            self._dispatch()
            self.last_finished = time.monotonic()
            if len(self.idle) == len(self.helpers) and not self.queue:
                reaper = threading.Timer(IDLE_S, self._end_if_idle)
                reaper.daemon = True
                reaper.start()
        if job is not None and ok and row is not None:
            # Kept where this process (and later ones) find it, whatever asks for it next: a
            # compile here that did not wait for the answer loads it from the store.
            from . import kernel_store
            store.default_store().put(kernel_store.NAMESPACE, key, row)
        if job is not None:
            job.ok, job.row, job.reason = ok, row, reason
            if not ok:
                debug.logger.debug("keraunos: a helper process did not compile a region: %s",
                                   reason)
            job.done.set()

    def _end_if_idle(self) -> None:
        """Helpers with nothing to do for ``IDLE_S`` are ended (each holds torch and Inductor in
        memory); the next region sent starts them again."""
        with self.lock:
            if (self.stopped or self.queue or len(self.idle) != len(self.helpers)
                    or time.monotonic() - self.last_finished < IDLE_S):
                return
            helpers, self.helpers, self.idle = self.helpers, [], []
            self.spawned = 0
        for helper in helpers:
            with contextlib.suppress(OSError):
                helper.process.stdin.close()  # the helper reads the end of its input and exits

    def lost(self, helper: Helper) -> None:
        with self.lock:
            job = helper.job
            if helper in self.helpers:
                self.helpers.remove(helper)
            if helper in self.idle:
                self.idle.remove(helper)
            if job is not None:
                self.jobs.pop(job.key, None)
        if job is not None:
            job.done.set()  # not ok: the region is compiled here

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            helpers, self.helpers, self.idle, self.queue = self.helpers, [], [], []
            jobs, self.jobs = list(self.jobs.values()), {}
        for helper in helpers:
            with contextlib.suppress(OSError):
                helper.process.kill()
        for job in jobs:
            job.done.set()


_pool: Pool | None = None
_pool_lock = threading.Lock()


def _the_pool() -> Pool:
    global _pool
    with _pool_lock:
        if _pool is None:
            # At least one: a fused tier compiled in the background has no other place to go.
            _pool = Pool(max(1, worker_count()), helps_here=worker_count() > 0)
            atexit.register(stop)
    return _pool


def available() -> bool:
    """Whether ``prefetch`` would send a region compiled in this process ahead to a helper now
    (helpers wanted, the machine not busy)."""
    return _the_pool().helps_here and not busy()


def start() -> None:
    """Start the helpers now (they take seconds to import torch and Inductor), for a fused tier
    that will be compiled by them: at the capture of a program that may be fused."""
    pool = _the_pool()
    if pool.size:
        pool.start()


def prefetch(key: str, graph, inputs, layout_choice, config_patches: dict,
             given: dict | None = None, always: bool = False) -> Job | None:
    """Send a region's compile to a helper; its job (None: not sent). Not while the machine is
    busy, unless ``always`` (the fused tier is compiled nowhere else): a helper then takes a
    core from the compiling thread or from the program itself.

    The helpers start with the first region sent (they take seconds to import torch and
    Inductor, and the compiling thread does not wait for them), not with the first fused compile:
    a process whose regions all load from the store, or are all compiled already, starts none."""
    if not (always and _the_pool().size) and not available():
        return None
    payload = job_payload(graph, inputs, layout_choice, config_patches, given)
    if payload is None:
        return None
    _pool.start()  # (none yet, or some lost)
    return _pool.prefetch(key, payload, needed=always)


def compile_elsewhere(key: str, graph, inputs, layout_choice, config_patches: dict,
                      given: dict) -> Job:
    """Have a helper compile the region and wait for it: the job says whether it did, with the
    row it made (``kernel_store.row``) or why not. Never compiles in this process."""
    job = prefetch(key, graph, inputs, layout_choice, config_patches, given, always=True)
    if job is None:
        failed = Job(key, b"")
        failed.reason = ("no helper process could be started" if _the_pool().stopped or
                         not _the_pool().helpers else "its graph could not be sent to a helper")
        return failed
    job.done.wait()
    return job


def wait_for(key: str) -> bytes | None:
    """Before compiling the region of ``key`` here: wait for the helper compiling it, if one is;
    the row it made (``kernel_store.row``: its generated module) when it compiled it, else None
    (none had started it, or it could not)."""
    job = _pool.claim(key) if _pool is not None else None
    if job is None:
        return None
    job.done.wait()
    return job.row if job.ok else None


def stop() -> None:
    if _pool is not None:
        _pool.stop()


def _write(stream, message) -> None:
    data = pickle.dumps(message)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _read(stream):
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError
    size, = struct.unpack("<Q", head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)
