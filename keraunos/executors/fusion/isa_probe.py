"""Inductor's probe of the CPU's vector instructions, remembered between processes.

Before its first CPU compile, every process has Inductor find which vector instructions it may
use (``torch._inductor.cpu_vec_isa.pick_vec_isa``): for each candidate it builds a small test
library (kept in its cache: built once per machine) and then, every time, starts a Python child
that loads it (``VecISA._probe_load``), ten children on an AVX-512 machine: 1.4 s of a warm
restart whose first fused step takes 2.9 s in all (the 4-layer training step), paid by
``torch.compile`` too.

A load that worked once works again while nothing it depends on changed, so a successful load is
kept in keraunos's store (``keraunos/store.py``) under a key made of the library's own bytes,
its path, the torch version, the Python executable and the kernel's release; a later process
finds it there and starts no child. A failed load is never kept (it is asked again, as Inductor
does), and when the store cannot be used the probe runs as Inductor's own.
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading

import torch

from ... import store

NAMESPACE = "inductor vector-ISA probe"
_installed: list[bool] = []
_lock = threading.Lock()


def remember_loads() -> None:
    """Make ``VecISA._probe_load`` consult the store first (once per process)."""
    from torch._inductor import cpu_vec_isa
    with _lock:
        if _installed:
            return
        original = cpu_vec_isa.VecISA._probe_load

        def probe_load(isa, output_path: str) -> bool:
            return remembered(original, isa, output_path, store.default_store())
        probe_load.__wrapped__ = original
        cpu_vec_isa.VecISA._probe_load = probe_load
        _installed.append(True)


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
