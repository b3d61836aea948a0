"""The executor protocol and the executors every compilation has: ``torch``, ``python``,
``OperatorExecutor``s of yours; the registry and the claims (see the package docstring)."""
from __future__ import annotations


from ..core.glue import Glue
from ..core.symbols import BoundSymbol, TorchSymbol
from ..core.runner import trace_step
from ..core.trace import Trace


class Executor:
    """Base class: ``name`` identifies it in ``jit(..., executors=[...])``."""

    name = "executor"

    def claims(self, bsym: BoundSymbol) -> bool:
        raise NotImplementedError

    def lower(self, bsym: BoundSymbol) -> BoundSymbol:
        """The line as it runs under this executor (by default: as written)."""
        return bsym

    def __repr__(self) -> str:
        return f"<executor {self.name}>"


class FusionExecutor(Executor):
    """An executor that fuses: it claims the lines it may run inside a region, and after the
    claims the pipeline hands it each trace (the forward, then the backward) to turn runs of its
    lines into one line each, calling what it compiled for the run.

    What the pipeline calls (``pipeline.fuse_regions``, ``tiers``), per fusion executor in the
    user's list:

    - ``fuse(trace, executors, *, observable, always_checked, records_autograd, forward,
      counter) -> (trace, regions)``: the new trace, and the regions it made (what
      ``keraunos.last_fusions`` lists). Lines it claimed but put in no region go to the next
      executor that claims them (``give_back``). ``observable``: names whose memory sharing the
      caller sees; ``always_checked``: inputs whose strides vary between calls (the backward's
      incoming gradients); ``records_autograd``: torch's autograd records the trace's ops (no
      backward trace of ours); ``forward``: for the backward, the forward's final trace;
      ``counter``: a one-item list numbering regions across the entry; ``min_shared_layers``:
      cut regions at layer boundaries (identical layers, identical regions) only where a trace
      calls at least this many layers of one kind (``JitOptions.min_shared_layers``).
    - ``computes_in_region(bsym)``: whether a region would compute this line itself (what the
      rule for programs worth fusing counts, ``tiers.worth_fusing``).
    - ``start_helpers()``: a program whose fused tier will be compiled in the background is
      about to be captured: processes that compile it may start now (called again each time).
    - ``compile_site(elsewhere)``: for an executor with ``compiles_elsewhere``, on the user's
      thread, what ``fuse`` and ``prefetch`` take as ``site``: where regions are compiled and
      what of the user's process that depends on (``elsewhere``: not in this process; see
      ``runtime/tiers.py``).
    - ``prefetch(trace, *, observable, always_checked, forward, min_shared_layers, site)``:
      optional; ``trace`` (the backward) will be fused after another trace (the forward): work
      on its regions may start now, elsewhere (the Inductor executor hands them to helper
      processes).

    A region line's symbol is ``glue.FusionCall(region, call)``; the region has ``name``,
    ``layer``, ``lines``, ``written``, ``describe_kernel()`` (the trace header's words for what
    runs it) and ``ready()`` (returns once what it runs is built; the fused tier switches in
    only then). ``source`` (one text about the region) is optional."""

    is_fusion = True
    # Whether ``fuse`` can have its regions compiled in helper processes (``site`` from
    # ``compile_site(True)``); one that cannot fuses ``fuse="background"`` programs at their
    # first call, on the calling thread (as ``"wait"``).
    compiles_elsewhere = False

    def fuse(self, trace: Trace, executors: list[Executor], *, observable: set[str],
             always_checked: set[str] = frozenset(), records_autograd: bool = False,
             forward: Trace | None = None, counter: list[int] | None = None,
             min_shared_layers: int = 2, site=None):
        raise NotImplementedError

    def computes_in_region(self, bsym: BoundSymbol) -> bool:
        return self.claims(bsym)

    def start_helpers(self) -> None:
        pass

    def compile_site(self, elsewhere: bool):
        return None

    def prefetch(self, trace: Trace, *, observable: set[str],
                 always_checked: set[str] = frozenset(), forward: Trace | None = None,
                 min_shared_layers: int = 2, site=None) -> None:
        pass


def give_back(bsym: BoundSymbol, executors: list[Executor]) -> BoundSymbol:
    """A line a fusion executor claimed but put in no region, for the first executor after the
    fusion executors that claims it."""
    for e in executors:
        if not getattr(e, "is_fusion", False) and e.claims(bsym):
            return bsym.replace(executor=e.name)
    raise NotImplementedError(f"keraunos: no executor after the fusion executors can run "
                              f"`{bsym.symbol.name}`; add 'torch' to the executors list")


def fusion_executors(executors) -> list[FusionExecutor]:
    return [e for e in executors if getattr(e, "is_fusion", False)]


class OperatorExecutor(Executor):
    """Runs the torch ops it has implementations for with callables of yours.

    ``register_implementation(op, fn, checker=None)``: lines calling ``op`` (the object the
    trace records: ``torch.nn.functional.gelu``, ``torch.Tensor.softmax``, an ATen overload in a
    backward trace) call ``fn`` with the same arguments instead, when ``checker(*args,
    **kwargs)`` (given the proxies: shapes, dtypes, devices) accepts them. The trace prints the
    line as a call of ``<executor>_<op>``. ``fn`` must compute what ``op`` computes: the
    backward keraunos derives is PyTorch's formula for ``op``."""

    def __init__(self, name: str):
        self.name = name
        self.implementations: dict[int, tuple] = {}  # id(op) -> (op, fn, checker)

    def register_implementation(self, op, fn, *, checker=None) -> None:
        self.implementations[id(op)] = (op, fn, checker)

    def claims(self, bsym):
        found = isinstance(bsym.symbol, TorchSymbol) and \
            self.implementations.get(id(bsym.symbol.fn))
        if not found:
            return False
        checker = found[2]
        return checker is None or bool(checker(*bsym.args, **bsym.kwargs))

    def lower(self, bsym):
        symbol = bsym.symbol
        _, fn, _ = self.implementations[id(symbol.fn)]
        short = symbol.name.rsplit(".", 1)[-1].strip("_") or "op"  # a method's self is args[0]
        return bsym.replace(symbol=TorchSymbol(fn, f"{self.name}_{short}", "opaque"))


class TorchExecutor(Executor):
    """Runs torch-level operations by calling the torch function itself: runs everything."""

    name = "torch"

    def claims(self, bsym):
        return isinstance(bsym.symbol, TorchSymbol)


class PythonExecutor(Executor):
    """Runs glue: prologue unpacking and checks, epilogue write-backs, ``del`` and ``return``."""

    name = "python"

    def claims(self, bsym):
        return isinstance(bsym.symbol, Glue)


_registry: dict[str, Executor] = {}


def register(executor: Executor) -> Executor:
    _registry[executor.name] = executor
    return executor


register(TorchExecutor())
register(PythonExecutor())

# Fusion by default, compiled in the background (runtime/tiers.py): the first calls run on the torch
# executor, later ones on Inductor's regions; ``jit(..., fuse="off")`` leaves just "torch".
DEFAULT_EXECUTORS = ("inductor", "torch")



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


@trace_step
def claim(trace: Trace, executors: list[Executor]) -> Trace:
    """Give each line to the first executor that claims it."""
    lines = []
    for bsym in trace.bound_symbols:
        for ex in executors:
            if ex.claims(bsym):
                lines.append(ex.lower(bsym.replace(executor=ex.name)))
                break
        else:
            raise NotImplementedError(
                f"keraunos: no executor among {[e.name for e in executors]} can run "
                f"`{bsym.symbol.name}` (from {bsym.source}); add 'torch' to the executors list")
    names = ", ".join(dict.fromkeys(b.executor for b in lines))
    return trace.derive(lines, f"Executor Claims [{names}]")

