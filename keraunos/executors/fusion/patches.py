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
last one out gives back what was there (unless something else replaced it since); the setting
and giving back is ``torch_internals.patching``'s. A helper process keeps them for its life
(``apply_for_good``).
"""
from __future__ import annotations

import functools

from ...torch_internals import patching


def _replacements(compiling: bool) -> list[patching.Replacement]:
    """(owner, attribute name, function making the replacement from the original)."""
    from ...torch_internals import inductor

    from . import collecting, isa_probe, one_build
    cpu_vec_isa, async_compile = inductor.cpu_vec_isa, inductor.AsyncCompile
    found = [(async_compile, "wait", collecting.waiting),
             (cpu_vec_isa.VecISA, "_probe_load", isa_probe.remembering)]
    if one_build.usable():
        found.append((async_compile, "cpp_pybinding", one_build.binding))
    if isa_probe.lazy_list_applies():
        found.append((cpu_vec_isa, "valid_vec_isa_list", isa_probe.lazy_list))
    if compiling:
        found.append((inductor.GraphLowering, "save_output_code", collecting.saving))
    return found


def applied(compiling: bool = False):
    """Within it, keraunos's replacements are in place (``compiling``: the compile's too)."""
    return patching.replaced(functools.partial(_replacements, compiling))


def apply_for_good(compiling: bool = True) -> None:
    """In a helper process: the replacements in place until it exits."""
    patching.replace_for_good(functools.partial(_replacements, compiling))


def in_place() -> list[str]:
    """What is replaced now (for tests)."""
    return patching.in_place()
