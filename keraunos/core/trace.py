"""Trace: an ordered list of bound symbols with a signature; printable, runnable Python.

``str(trace)`` and ``trace.python_callable()`` come from the same generated source, so what you
read is what runs (the source that runs calls each ATen overload through its bound C++ entry
point, where the printed one says ``torch.ops.aten.X.Y``; ``fn.__keraunos_source__`` is it). Passes never mutate a trace: they return a new one whose header says which pass
made it and how long it took.
"""
from __future__ import annotations

import itertools
import linecache
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import lint as _lint
from .proxies import Proxy
from .symbols import BoundSymbol, CodeWriter

_trace_counter = itertools.count()
# Numbers of generated files whose code was freed, for reuse. CPython 3.11 keeps every distinct
# filename a code object was compiled with for the life of the process (about 70 bytes each), so
# a program that keeps recompiling must not mint a new filename for every trace it compiles.
_free_numbers: list[int] = []


def _file_number() -> int:
    try:
        return _free_numbers.pop()
    except IndexError:  # none free (``pop`` is atomic: threads compiling at once are safe)
        return next(_trace_counter)


def _release_file(filename: str, number: int) -> None:
    linecache.cache.pop(filename, None)
    _free_numbers.append(number)


@dataclass
class Trace:
    """A program: ``def name(params): <bound symbols>``.

    ``params`` are the signature's entries (proxies, or strings such as ``"*args"``);
    ``bound_symbols`` end with the line that returns. ``header`` holds comment lines describing how
    this trace came to be.
    """

    name: str
    params: list[Any]
    bound_symbols: list[BoundSymbol]
    header: list[str] = field(default_factory=list)
    # Objects the generated code refers to by name, beyond ``torch`` and what symbols add.
    namespace: dict[str, Any] = field(default_factory=dict)
    # How long the pass that made this trace took (the last header line says so too).
    seconds: float = 0.0

    def derive(self, bound_symbols: list[BoundSymbol], label: str, seconds: float | None = None,
               params: list[Any] | None = None) -> "Trace":
        """A new trace with these lines, its header extended by ``label`` (the pass that made it)."""
        timing = f" (took {seconds * 1e3:.2f} ms)" if seconds is not None else ""
        derived = Trace(self.name, list(self.params if params is None else params), bound_symbols,
                        self.header + [f"Constructed by {label}{timing}"], dict(self.namespace),
                        seconds or 0.0)
        if _lint.enabled():
            derived.lint()
        return derived

    def untimed(self) -> bool:
        """Made by ``derive`` without a time: the pass runner stamps it (``core/runner.py``)."""
        return bool(self.header) and not self.header[-1].endswith(" ms)")

    def stamp(self, seconds: float) -> None:
        """The runner's time for the step that just made this trace."""
        self.seconds = seconds
        self.header[-1] += f" (took {seconds * 1e3:.2f} ms)"

    def lint(self) -> None:
        """Check that the trace is well formed (names bound before they are read, once, never
        read after their ``del``); raises ``TraceLintError`` saying where it is not. See
        ``keraunos.core.lint``."""
        _lint.check(self)

    def with_bound_symbols(self, bound_symbols: list[BoundSymbol]) -> "Trace":
        """A copy of this trace with other lines; for a ``Transform`` (``jit`` labels the result
        with the transform's name and time)."""
        return Trace(self.name, list(self.params), list(bound_symbols), list(self.header),
                     dict(self.namespace))

    def source(self, executable: bool = False, boxed: bool = False) -> tuple[str, dict[str, Any]]:
        """The Python of this trace and the namespace it runs in; ``executable``: the source
        ``python_callable`` compiles (see ``CodeWriter``); ``boxed``: see ``python_callable``."""
        namespace: dict[str, Any] = {"torch": torch, **self.namespace}
        w = CodeWriter(namespace, executable)
        params = []
        for p in self.params:
            if isinstance(p, Proxy):
                params.append(p.name)
                w.defined.add(p.name)
            else:
                params.append(str(p))
        lines = [f"# {h}" for h in self.header]
        lines.append(f"def {self.name}({'_args' if boxed else ', '.join(params)}):")
        for p in self.params:
            if isinstance(p, Proxy) and (p.provenance or p.describe()):
                parts = [x for x in (p.describe(), p.provenance and f"from {p.provenance}") if x]
                lines.append(f"  # {p.name}: {' '.join(parts)}")
        if boxed:  # the caller holds none of them now: a ``del`` of one frees it
            lines += [f"  ({''.join(n + ', ' for n in params)}) = _args", "  _args.clear()"]
        last_source = None
        for bsym in self.bound_symbols:
            if bsym.source is not None and bsym.source != last_source:
                lines.append(f"  # {bsym.source}")
                last_source = bsym.source
            for line in bsym.symbol.format(bsym, w):
                lines.append("  " + line)
            w.defined.update(p.name for p in bsym.output_proxies())
        if len(lines) == len(self.header) + 1:
            lines.append("  pass")
        return "\n".join(lines) + "\n", namespace

    def __str__(self) -> str:
        return self.source()[0]

    def __repr__(self) -> str:
        return f"<Trace {self.name}: {len(self.bound_symbols)} lines>"

    def python_callable(self, boxed: bool = False) -> Callable:
        """Compile this trace; tracebacks point into its source (registered with ``linecache``).
        ``boxed``: the function takes its inputs in one list, which it empties, so that each is
        freed where the trace deletes it (a backward's saved tensors)."""
        if _lint.enabled():
            self.lint()
        src, namespace = self.source(executable=True, boxed=boxed)
        number = _file_number()
        filename = f"<keraunos {self.name} #{number}>"
        linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
        exec(compile(src, filename, "exec"), namespace)
        fn = namespace[self.name]
        fn.__keraunos_source__ = src
        # The source goes with the code: an evicted cache entry leaves nothing behind. The code,
        # not the function, because a traceback keeps the code (and needs the source) after the
        # function is gone; the filename is reused only once nothing can show it.
        weakref.finalize(fn.__code__, _release_file, filename, number)
        return fn
