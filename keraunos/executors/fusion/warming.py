"""Inductor's one-time set-up, started in the background before the first fused compile needs it.

The first CPU compile of a process waits for two things that do not depend on the program: the
import of Inductor's runtime modules, and Inductor's probe of the CPU's vector instructions (a
g++ test build and a load of its library: 2.7 s on a cold cache here). ``start_warming`` starts
both on a thread of their own when a module that may fuse begins its capture (``pipeline``,
through ``Executor.start_warming``) or at a function's first background compile (``tiers``), so
they overlap the capture instead of following it. The probe's build runs at a lower priority
(``WARMING_NICE``) so that it takes only what the caller leaves of the cores.

``compiler`` waits here: for the imports before any use of Inductor
(``wait_for_warming_imports``), and for the probe only at a compile's code generation
(``before_the_first_pick``) or before a stored module's C++ loads (``probe_vector_isa``). Every
probe goes through one lock, so two first probes never run at once.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading

from ..base import IMPORT_LOCK
from . import isa_probe, turns


_warming: list[threading.Thread] = []
_warming_lock = threading.Lock()
_warmed_imports = threading.Event()


def start_warming() -> None:
    """Start, in the background, what the first CPU compile of a process waits for: the import of
    Inductor's runtime modules and its probe of the vector instructions it may use (a g++ build
    and a load of a test library: 2.7 s on a cold cache here). Once per process; returns
    without waiting for it (after importing torch._dynamo, when capture has not yet: below).

    A module's capture calls it (``pipeline``, through ``Executor.start_warming``), so the
    probe's g++ build runs on the other core while the first call captures the program, instead
    of after it (the 32-layer model's first fused call came 2.8 s after its first result, most of
    it this probe); the fusion worker calls it too (a function's first background compile).
    Not ``keraunos.jit``: the import of torch._dynamo below then cost every jitted function's
    restart 0.9 s, a restart that loads its program from the store and imports nothing else."""
    if _warming:
        return
    # What the caller's capture imports itself (a ShapeEnv imports torch._dynamo through
    # ``validator``), imported here first, on the caller's thread: the warming thread's imports
    # of Inductor import torch._dynamo too, and two threads importing that circle of modules at
    # once meet one of them half initialized (the fuzzer's 2413:0, an ImportError in the
    # capture). Not an extra cost: the first call's capture would import them anyway. (Outside
    # ``_warming_lock``: IMPORT_LOCK is never taken while that one is held.)
    with IMPORT_LOCK:
        import torch._dynamo  # noqa: F401
        import torch.fx.experimental.validator  # noqa: F401
    with _warming_lock:
        if _warming:
            return
        thread = threading.Thread(target=_warm, name="keraunos-inductor-warming", daemon=True)
        _warming.append(thread)
        thread.start()


def wait_for_warming_imports() -> None:
    """Return once the warming thread has imported Inductor's modules (at once when no warming
    was started). Any thread that imports or runs Inductor's compiler waits here first: two
    threads importing torch._dynamo's circle of modules at once can meet one of them half
    initialized (an ImportError)."""
    if _warming:
        _warmed_imports.wait()


# How much lower the probe's priority is than the process's, once the warming thread has done
# its imports: its g++ test build (a child inherits the thread's nice value on Linux) then takes
# only what the caller's capture leaves of the cores. On a quiet machine that is a whole idle
# core; on a loaded one (or one core) the probe waits for the capture instead of halving its
# share: at normal priority, a 32-layer model's first result came 4-5x later on this loaded
# 2-core machine. The imports keep the process's priority: the fusion worker waits for them
# (``wait_for_warming_imports``), and at a lower priority a restart's fused tier waited behind
# the caller's own work for them. A compile whose code generation waits for the probe (at the
# candidate list's lock) still waits for a low-priority build: only when the cores are taken.
WARMING_NICE = 10


def _lower_this_threads_priority(by: int) -> None:
    """Lower the calling thread's scheduling priority (Linux: ``setpriority`` of a thread id
    acts on that thread alone, and processes it starts inherit it); nothing elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + by))


def _warm() -> None:
    try:
        # Not Inductor's compiler (``compile_fx``, its lowering and ``select_algorithm``: about
        # 0.6 s even with torch._dynamo imported): a restart whose regions all come from
        # keraunos's store never needs it, and the first compile imports it (under IMPORT_LOCK).
        with IMPORT_LOCK:
            from torch._inductor import async_compile, codecache, cpp_builder  # noqa: F401
            from torch._inductor import cpu_vec_isa  # noqa: F401
            turns.dynamo_takes_turns()  # before any fused compile can run on another thread
    except Exception:  # noqa: BLE001 - the first compile will meet and report it
        return
    finally:
        _warmed_imports.set()
    _lower_this_threads_priority(WARMING_NICE)  # for good: the thread ends with the probe
    probe_vector_isa()


def before_the_first_pick() -> None:
    """What a compile does before ``compile_fx``, about the vector-ISA probe the warming thread
    may be running. With keraunos's candidate list installed (``isa_probe``), every pick takes the
    list's lock, so the compile's first pick (at code generation, after the lowering, which needs
    no ISA) waits there for the probe's build: the lowering overlaps the g++ test build. Without
    it (not x86), the compile waits for the probe first, as two first probes at once must not
    run (``_probe_lock``)."""
    isa_probe.install()
    if not isa_probe.picks_take_turns():
        probe_vector_isa()


# Inductor's first probe of the vector instructions is not safe to run on two threads at once:
# ``VecAVX512.__bool__`` adds ``-mavx512bf16`` to the ISA's flags while it test-builds, and
# restores what it saw, so two first probes at once leave the flag in twice for the rest of the
# process. The flags are part of every C++ kernel's cache key: such a process builds every kernel
# under a key no other process uses, and the next process rebuilds them all (measured on the
# 4-layer training step: 12 of 12 kernels rebuilt on a warm restart). Every probe keraunos starts
# goes through this lock, so the first one runs alone and the rest find it cached.
_probe_lock = threading.Lock()


def probe_vector_isa() -> None:
    """Inductor's pick of the vector ISA, made once per process (the first pick test-builds),
    never on two threads at once; returns once it is made."""
    from torch._inductor import cpu_vec_isa
    isa_probe.install()  # one test build, not four; a later process starts no child to load it
    with _probe_lock:
        try:
            cpu_vec_isa.pick_vec_isa()  # cached: later compiles find it done
        except Exception:  # noqa: BLE001 - the compile itself will meet and report it
            pass
