"""Inductor's functions that keraunos replaces, replaced only while keraunos compiles or loads a
region in this process, on the calling thread, and given back after.

What is replaced, and by what:

- ``AsyncCompile.wait`` (``collecting.waiting``): a wrapper module's wait for its C++ kernels is
  put off until the region's first call, and its kernels are built by one g++ run;
- ``AsyncCompile.cpp_pybinding`` (``one_build.binding``): a kernel's build is collected for that
  one run instead of started alone;
- ``GraphLowering.save_output_code`` (``collecting.saving``, while compiling only): the generated
  wrapper's source is kept for ``keraunos.last_fusions``;
- ``cpu_vec_isa.valid_vec_isa_list`` and ``VecISA._probe_load`` (``isa_probe``): the vector-ISA
  probe test-builds only the candidate Inductor reads, and a load that worked before is
  remembered in keraunos's store.

Each replacement calls Inductor's own function wherever keraunos is not collecting (another
thread, or outside ``collecting.from_inductor``), so a user thread that compiles while one is in
place gets Inductor's behaviour. ``applied()`` nests and counts: the first one in replaces, the
last one out gives back what was there (unless something else replaced it since). A helper
process keeps them for its life (``apply_for_good``).
"""
from __future__ import annotations

import contextlib
import threading

_lock = threading.RLock()
_applied: dict[tuple[int, str], list] = {}  # (id(owner), name) -> [count, owner, original]


def _replacements(compiling: bool) -> list[tuple[object, str, object]]:
    """(owner, attribute name, function making the replacement from the original)."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.async_compile import AsyncCompile

    from . import collecting, isa_probe, one_build
    found = [(AsyncCompile, "wait", collecting.waiting),
             (cpu_vec_isa.VecISA, "_probe_load", isa_probe.remembering)]
    if one_build.usable():
        found.append((AsyncCompile, "cpp_pybinding", one_build.binding))
    if isa_probe.lazy_list_applies():
        found.append((cpu_vec_isa, "valid_vec_isa_list", isa_probe.lazy_list))
    if compiling:
        from torch._inductor.graph import GraphLowering
        found.append((GraphLowering, "save_output_code", collecting.saving))
    return found


def _take(owner, name: str, make) -> None:
    key = (id(owner), name)
    held = _applied.get(key)
    if held is not None:
        held[0] += 1
        return
    original = owner.__dict__.get(name, getattr(owner, name, None))
    if getattr(original, "_keraunos_patch", False):  # in place for good (a helper process)
        _applied[key] = [1, owner, None]
        return
    replacement = make(original)
    replacement._keraunos_patch = True
    replacement.__wrapped__ = original
    setattr(owner, name, replacement)
    _applied[key] = [1, owner, original]


def _give_back(owner, name: str) -> None:
    key = (id(owner), name)
    held = _applied.get(key)
    if held is None:
        return
    held[0] -= 1
    if held[0] > 0:
        return
    del _applied[key]
    _, owner, original = held
    if original is None:
        return
    current = owner.__dict__.get(name, getattr(owner, name, None))
    if getattr(current, "__wrapped__", None) is original:  # not replaced by someone since
        setattr(owner, name, original)


@contextlib.contextmanager
def applied(compiling: bool = False):
    """Within it, keraunos's replacements are in place (``compiling``: the compile's too)."""
    with _lock:
        taken = _replacements(compiling)
        for owner, name, make in taken:
            _take(owner, name, make)
    try:
        yield
    finally:
        with _lock:
            for owner, name, _ in taken:
                _give_back(owner, name)


def apply_for_good(compiling: bool = True) -> None:
    """In a helper process: the replacements in place until it exits."""
    with _lock:
        for owner, name, make in _replacements(compiling):
            _take(owner, name, make)


def in_place() -> list[str]:
    """What is replaced now (for tests)."""
    with _lock:
        return sorted(f"{type(v[1]).__name__ if not isinstance(v[1], type) else v[1].__name__}."
                      f"{k[1]}" for k, v in _applied.items())
