"""Executors: who runs each line of a trace.

An executor claims the bound symbols it can run; ``claim`` walks a trace and gives each line to
the first executor in the user's list that claims it. Operator executors map one symbol to one
callable; the ``torch`` executor claims every torch-level operation, the ``python`` executor the
glue of prologues and epilogues (unpacking, checks, write-backs). The ``inductor`` fusion
executor (``executors=["inductor", "torch"]``, see ``executors/fusion``) claims the lines it may
fuse, and after the claims each run of them becomes one line calling an Inductor-compiled
region; what it leaves goes to the next executor in the list. A custom kernel plugs in by
registering an executor whose ``claims`` accepts the symbols it implements:

    >>> import keraunos
    >>> class MyGelu(keraunos.executors.Executor):
    ...     name = "my_gelu"
    ...     def claims(self, bsym):
    ...         return getattr(bsym.symbol, "name", "") == "torch.nn.functional.gelu"
    >>> keraunos.executors.register(MyGelu())
"""
from __future__ import annotations

import time

from ..core.symbols import BoundSymbol, GlueSymbol, TorchSymbol
from ..core.trace import Trace


class Executor:
    """Base class: ``name`` identifies it in ``jit(..., executors=[...])``."""

    name = "executor"

    def claims(self, bsym: BoundSymbol) -> bool:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<executor {self.name}>"


class TorchExecutor(Executor):
    """Runs torch-level operations by calling the torch function itself: runs everything."""

    name = "torch"

    def claims(self, bsym):
        return isinstance(bsym.symbol, TorchSymbol)


class PythonExecutor(Executor):
    """Runs glue: prologue unpacking and checks, epilogue write-backs, ``del`` and ``return``."""

    name = "python"

    def claims(self, bsym):
        return isinstance(bsym.symbol, GlueSymbol)


_registry: dict[str, Executor] = {}


def register(executor: Executor) -> Executor:
    _registry[executor.name] = executor
    return executor


register(TorchExecutor())
register(PythonExecutor())

DEFAULT_EXECUTORS = ("torch",)


def resolve(executors) -> list[Executor]:
    """The executor list for ``jit``: names or ``Executor`` objects; ``python`` always comes last."""
    result = []
    for e in executors or DEFAULT_EXECUTORS:
        if isinstance(e, str):
            if e not in _registry:
                raise ValueError(f"keraunos.jit: unknown executor {e!r}; registered executors are "
                                 f"{sorted(_registry)} (add one with keraunos.executors.register)")
            e = _registry[e]
        if not isinstance(e, Executor):
            raise TypeError(f"keraunos.jit: executors must be names or Executor objects, got {e!r}")
        result.append(e)
    if _registry["python"] not in result:
        result.append(_registry["python"])
    return result


def claim(trace: Trace, executors: list[Executor]) -> Trace:
    """Give each line to the first executor that claims it."""
    start = time.perf_counter()
    lines = []
    for bsym in trace.bound_symbols:
        for ex in executors:
            if ex.claims(bsym):
                lines.append(bsym.replace(executor=ex.name))
                break
        else:
            raise NotImplementedError(
                f"keraunos: no executor among {[e.name for e in executors]} can run "
                f"`{bsym.symbol.name}` (from {bsym.source}); add 'torch' to the executors list")
    names = ", ".join(dict.fromkeys(b.executor for b in lines))
    return trace.derive(lines, f"Executor Claims [{names}]", time.perf_counter() - start)


from .fusion import InductorExecutor  # noqa: E402 - a subclass of Executor, defined above

register(InductorExecutor())
