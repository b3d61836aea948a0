"""Inductor's probe of the CPU's vector instructions, remembered between processes.

Before its first CPU compile, every process has Inductor find which vector instructions it may
use (Inductor's ``cpu_vec_isa.pick_vec_isa``): for each candidate it builds a small test
library (kept in its cache: built once per machine) and then, every time, starts a Python child
that loads it (``VecISA._probe_load``), ten children on an AVX-512 machine: 1.4 s of a warm
restart whose first fused step takes 2.9 s in all (the 4-layer training step), paid by
``torch.compile`` too.

A load that worked once works again while nothing it depends on changed, so a successful load is
kept in keraunos's store (``keraunos/persist/store.py``) under a key made of the library's own bytes,
its path, the torch version, the Python executable and the kernel's release; a later process
finds it there and starts no child. A failed load is never kept (it is asked again, as Inductor
does), and when the store cannot be used the probe runs as Inductor's own.

The probe also builds less (``lazy_list``). Inductor test-builds every candidate the
CPU claims (four g++ builds on an AMX machine: 8.5 s of a cold first compile, quiet, one after
another) and then uses the first that works, unless ``config.cpp.simdlen`` or
``ATEN_CPU_CAPABILITY`` asks for another. Keraunos gives Inductor the same list of candidates,
in the same order, whose test builds run only when Inductor reads that far: the usual pick builds
one (2.7 s), and a pick by width or name builds what it passes on its way, as before.
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
from collections.abc import Sequence

import torch

from ...persist import store

NAMESPACE = "inductor vector-ISA probe"
_lock = threading.Lock()


def lazy_list_applies() -> bool:
    """Whether ``lazy_list`` replaces Inductor's list here (x86 on Linux or Windows)."""
    import platform
    return sys.platform in ("linux", "win32") and platform.machine() in ("x86_64", "AMD64")


_candidates: list = []  # the one CandidateList of this process, once made


def lazy_list(original):
    """``cpu_vec_isa.valid_vec_isa_list``'s replacement (``patches``): it returns the process's
    ``CandidateList``, whose test builds run only as far as a pick reads."""
    from ...torch_internals.inductor import cpu_vec_isa
    with _lock:
        if not _candidates:
            claimed = cpu_vec_isa.x86_isa_checker()
            _candidates.append(CandidateList(
                [isa for isa in cpu_vec_isa.supported_vec_isa_list
                 if all(flag in claimed for flag in str(isa).split())]))
        candidates = _candidates[0]

    def valid_vec_isa_list():
        return candidates
    valid_vec_isa_list._keraunos_lazy = True
    valid_vec_isa_list.cache_clear = candidates.forget  # as Inductor's functools.cache has
    return valid_vec_isa_list


def picks_take_turns() -> bool:
    """Whether Inductor's picks go through a ``CandidateList`` (``lazy_list``
    installed it): then picks on two threads at once take turns at its lock, and the first one's
    test builds run alone."""
    from ...torch_internals.inductor import cpu_vec_isa
    return bool(getattr(cpu_vec_isa.valid_vec_isa_list, "_keraunos_lazy", False))


class CandidateList(Sequence):
    """The candidates that build and load, in the order given, each test-built (``bool(isa)``)
    only when a reader gets to it: ``[0]``, ``bool()`` and a loop that stops early build only
    what they pass; ``len()`` builds them all. Inductor's list, read the way ``pick_vec_isa``
    reads it."""

    def __init__(self, claimed: list):
        self._claimed = list(claimed)
        self._lock = threading.Lock()
        self.forget()

    def forget(self) -> None:
        with self._lock:
            self._asked = 0  # how many of the claimed candidates were test-built
            self._valid: list = []

    def _valid_up_to(self, count: int | None) -> list:
        """The valid candidates, built until ``count`` are known (None: all)."""
        with self._lock:
            while (count is None or len(self._valid) < count) and self._asked < len(self._claimed):
                isa = self._claimed[self._asked]
                if isa:  # Inductor's cached test build
                    self._valid.append(isa)
                self._asked += 1
            return list(self._valid)

    def __getitem__(self, index):
        if isinstance(index, int) and index >= 0:
            return self._valid_up_to(index + 1)[index]
        return self._valid_up_to(None)[index]

    def __len__(self) -> int:
        return len(self._valid_up_to(None))

    def __bool__(self) -> bool:
        return bool(self._valid_up_to(1))

    def __iter__(self):
        found = 0
        while True:
            valid = self._valid_up_to(found + 1)
            if len(valid) <= found:
                return
            yield valid[found]
            found += 1

    def __repr__(self) -> str:
        valid = ", ".join(map(str, self._valid))
        untested = ", ".join(map(str, self._claimed[self._asked:]))
        return f"CandidateList(valid=[{valid}], untested=[{untested}])"


def remembering(original):
    """``VecISA._probe_load``'s replacement (``patches``): the store is asked first."""
    def probe_load(isa, output_path: str) -> bool:
        return remembered(original, isa, output_path, store.default_store())
    return probe_load


def remembered(probe, isa, output_path: str, where: store.Store) -> bool:
    """``probe(isa, output_path)``, unless ``where`` says this library loaded before."""
    key = load_key(output_path)
    if key is not None and where.get(NAMESPACE, key) == b"loaded":
        return True
    loaded = probe(isa, output_path)
    if loaded and key is not None:
        where.put(NAMESPACE, key, b"loaded")
    return loaded


def load_key(output_path: str) -> str | None:
    """What decides whether the library at ``output_path`` loads: its bytes, where it is, and the
    torch, Python and kernel that load it. None when the library cannot be read."""
    try:
        with open(output_path, "rb") as f:
            library = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None
    parts = (library, os.path.realpath(output_path), torch.__version__, sys.executable,
             os.uname().release)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()
