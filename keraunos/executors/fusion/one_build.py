"""A region's C++ kernels built by one g++ run, instead of one run for each kernel.

Inductor's wrapper module for a CPU graph defines each of its C++ kernels with
``async_compile.cpp_pybinding(argtypes, source)``: one source file, one g++ run and one shared
library per kernel, each run paying g++'s start, the precompiled header's load and the link again.
Measured on this machine (2026-12-05, load average about 6): a kernel of the 4-layer training
step's backward layer region takes 0.7 CPU-seconds to build, an empty kernel 0.5; the region's five
kernels take 3.7 CPU-seconds built one by one and 1.0 built as one file.

So, while a compile's waits are collected (``collecting.from_inductor``), the
definitions of one wrapper module are collected too (``collecting``): each kernel becomes a
placeholder (``Pending``), and when the module reaches its ``async_compile.wait(globals())``,
``start`` writes every kernel of it into one file, each in a namespace of its own
(``keraunos_kernel_{i}``), with one Python binding ``k{i}`` per kernel (Inductor's own argument
parsing, from its template), and hands that one build to Inductor's pool. The wait then puts each
binding where its placeholder was in the module's globals (``finish``), as Inductor's wait puts a
built kernel where its future was. The file is kept in Inductor's C++ cache under the hash of its
source, like any kernel: a later process whose wrapper defines the same kernels in the same order
finds it built.

What is not merged keeps Inductor's own way: a module with one kernel (its file stays Inductor's,
shared with ``torch.compile``'s caches), a kernel source not of the usual shape (one
``#include`` of Inductor's prefix header, one ``extern "C" void kernel(``), a torch whose
binding template is not the one read here (then nothing is merged). A merged build that fails is
built again kernel by kernel (Inductor's own path), so a kernel g++ cannot build fails exactly as
it would have.
"""
from __future__ import annotations

import functools
import re
import threading
from concurrent.futures import Future

from ...torch_internals import inductor

_PREFIX = "#include <torch/csrc/inductor/cpp_prefix.h>"
_ENTRY = re.compile(r'extern "C"\s+void\s+kernel\(')

# Builds started (``start``): "merged" files of several kernels and the kernels in them, "alone"
# (a module with one kernel), and "failed": merged builds that were built again one by one.
stats = {"merged": 0, "kernels": 0, "alone": 0, "failed": 0}
_first_failure: list[str] = []  # what the first failed merged build raised, in one line
_local = threading.local()  # .batch: this thread's kernels met since the last wait, or None
_install_lock = threading.Lock()
_installed: list[bool] = []


class Pending(Future):
    """What a collected ``cpp_pybinding`` returns: a kernel whose build has not started yet. It
    stands in the wrapper module's globals until ``finish`` replaces it (a ``Future``, so that
    Inductor's own wait, should it ever meet one, waits for it as for its own)."""

    def __init__(self, argtypes, source: str):
        super().__init__()
        self.argtypes, self.source = list(argtypes), source


def mergeable(source: str) -> bool:
    """Whether a kernel's source has the shape the merge rewrites: Inductor's prefix header,
    included once, first, and one entry point ``extern "C" void kernel(``, nothing else external."""
    return (source.lstrip().startswith(_PREFIX) and source.count("#include") == 1
            and len(_ENTRY.findall(source)) == 1 and source.count('extern "C"') == 1)


def usable() -> bool:
    """Whether Inductor's binding template is the one this module reads (otherwise nothing is
    merged and ``AsyncCompile.cpp_pybinding`` is left as it is)."""
    with _install_lock:
        if not _installed:
            _installed.append(inductor.binding_template_parts() is not None)
        return _installed[0]


def binding(original):
    """``AsyncCompile.cpp_pybinding``'s replacement (``patches``): on a thread inside
    ``collecting``, a mergeable kernel is collected (a ``Pending``) instead of built alone;
    elsewhere it is Inductor's own."""
    def cpp_pybinding(self, argtypes, source_code):
        batch = getattr(_local, "batch", None)
        if batch is None or not mergeable(source_code):
            return original(self, argtypes, source_code)
        pending = Pending(argtypes, source_code)
        batch.append(pending)
        return pending
    functools.update_wrapper(cpp_pybinding, original)
    return cpp_pybinding


class collecting:
    """Within it, this thread's wrapper modules collect their C++ kernels (``start`` takes
    them at each module's wait). Re-entrant: an inner one keeps the outer's batch."""

    def __enter__(self):
        self._outer = getattr(_local, "batch", None)
        if self._outer is None and usable():
            _local.batch = []
        return self

    def __exit__(self, *exc):
        if self._outer is None:
            _local.batch = None
        return False


def start():
    """At a wrapper module's wait: start one build of the kernels it defined (since the last
    wait on this thread) and return ``finish(scope)``, which waits for it and puts each kernel
    in the module's globals; None when nothing was collected."""
    batch = getattr(_local, "batch", None)
    if not batch:
        return None
    kernels, batch[:] = list(batch), []
    Bindings = inductor.CppPythonBindingsCodeCache
    submit = inductor.AsyncCompile.submit if inductor.get_compile_threads() > 1 else None
    try:
        if len(kernels) == 1:  # Inductor's own file: shared with torch.compile's caches
            one = kernels[0]
            get = Bindings.load_pybinding_async(one.argtypes, one.source, submit_fn=submit)
            results = lambda: [get()]  # noqa: E731
            stats["alone"] += 1
        else:
            get = Bindings.load_async(merged_source(kernels), "cpu", submit_fn=submit)
            results = lambda: [getattr(get(), f"k{i}") for i in range(len(kernels))]  # noqa: E731
            stats["merged"] += 1
            stats["kernels"] += len(kernels)
    except Exception:  # noqa: BLE001 - (writing the file, the pool): each kernel on its own
        results = None

    def finish(scope: dict) -> None:
        try:
            if results is None:
                raise RuntimeError("the merged build did not start")
            built = results()
        except Exception as e:  # noqa: BLE001 - each kernel alone, as Inductor builds it
            # (raises what g++ says about a kernel that does not build, as without the merge)
            _failed(e)
            built = [Bindings.load_pybinding(k.argtypes, k.source) for k in kernels]
        for kernel, made in zip(kernels, built):
            kernel.set_result(made)
        for name, value in list(scope.items()):
            if isinstance(value, Pending):
                scope[name] = value.result()
    return finish


def _failed(error: Exception) -> None:
    from ...debug import logger
    text = (str(error).strip().splitlines() or [""])[0][:200]
    stats["failed"] += 1
    if not _first_failure:
        _first_failure.append(f"{type(error).__name__}: {text}")
    logger.debug("keraunos: a merged kernel build failed (%s: %s); its kernels are built one by "
                 "one", type(error).__name__, text)


def describe() -> str:
    """How this process builds a fused module's C++ kernels: "one file per module", or why
    some or all are built one by one (Inductor's own way, one g++ run per kernel)."""
    if not usable():
        return ("one by one (this torch's Inductor binding template is not the one keraunos "
                "merges)")
    if stats["failed"]:
        return (f"one file per module, except {stats['failed']} merged build(s) that failed and "
                f"were built one by one (the first: {_first_failure[0]})")
    return "one file per module"


def merged_source(kernels: list[Pending]) -> str:
    """One C++ file of every kernel, ``kernel`` of the i-th in namespace ``keraunos_kernel_{i}``,
    with a Python module ``kernel`` whose function ``k{i}`` calls it (Inductor's template, cut
    by ``torch_internals.inductor.binding_template_parts``, whatever calling convention it has:
    ``METH_VARARGS`` to torch 2.14, ``METH_FASTCALL`` from 2.15)."""
    pre, function, entry, tail = inductor.binding_template_parts()
    parts = [_PREFIX]
    for i, kernel in enumerate(kernels):
        body = kernel.source.lstrip()[len(_PREFIX):]
        parts.append(f"namespace keraunos_kernel_{i} {{\n{_ENTRY.sub('void kernel(', body)}\n}}")
    parts.append(pre.format(entry_func="kernel", extra_parse_arg=inductor.binding_parse_arg()))
    for i, kernel in enumerate(kernels):
        parse = ", ".join(f"parse_arg<{t.replace('const ', '')}>(args, {n})"
                          for n, t in enumerate(kernel.argtypes))
        parts.append(function.format(
            entry_func=f"k{i}", arg_len=len(kernel.argtypes),
            call_entry_func=f"keraunos_kernel_{i}::kernel({parse}); Py_RETURN_NONE;"))
    methods = "".join(entry.format(entry_func=f"k{i}") for i in range(len(kernels)))
    parts.append(inductor.BINDING_TABLE_OPEN.format() + methods
                 + inductor.BINDING_TABLE_CLOSE.format() + tail.format(entry_func="kernel"))
    return "\n".join(parts)
