"""Inductor's probe of the CPU's vector instructions, made once per process and never on two
threads at once.

Before a process's first CPU compile or load of a generated module, Inductor finds which vector
instructions it may use (Inductor's ``cpu_vec_isa.pick_vec_isa``): a g++ test build (kept
in Inductor's cache: once per machine) and a load of its library. keraunos's ``isa_probe`` makes
it build only the candidate read and remembers the load between processes. In this process the
probe runs on the user's thread (an in-process compile, or the switch to a fused tier, which
loads modules the helper processes generated); each helper process probes at its start.
"""
from __future__ import annotations

import threading

from . import isa_probe


def before_the_first_pick() -> None:
    """What a compile does before ``compile_fx`` (within ``patches.applied``), about the
    vector-ISA probe. With keraunos's candidate list in place (``isa_probe``), every pick takes the list's lock and the compile's
    first pick (at code generation) builds what it reads; without it (not x86), the probe is
    made first, alone (``_probe_lock``)."""
    if not isa_probe.picks_take_turns():
        probe_vector_isa()


# Inductor's first probe of the vector instructions is not safe to run on two threads at once:
# ``VecAVX512.__bool__`` adds ``-mavx512bf16`` to the ISA's flags while it test-builds, and
# restores what it saw, so two first probes at once leave the flag in twice for the rest of the
# process. The flags are part of every C++ kernel's cache key: such a process builds every kernel
# under a key no other process uses, and the next process rebuilds them all. Every probe keraunos
# starts goes through this lock, so the first one runs alone and the rest find it cached.
_probe_lock = threading.Lock()


def probe_vector_isa() -> None:
    """Inductor's pick of the vector ISA, made once per process (the first pick test-builds),
    never on two threads at once; returns once it is made."""
    from ...torch_internals.inductor import cpu_vec_isa

    from . import patches
    # (one test build, not four; a later process starts no child to load it)
    with patches.applied(), _probe_lock:
        try:
            cpu_vec_isa.pick_vec_isa()  # cached: later compiles find it done
        except Exception:  # noqa: BLE001 - the compile itself will meet and report it
            pass
