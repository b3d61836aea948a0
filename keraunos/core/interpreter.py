"""Running a trace's lines on values of your choosing, as ``torch.fx.Interpreter`` runs a graph.

``trace.python_callable()`` runs a trace on real tensors as generated Python. Some stages need to
walk it with other values instead: the joint forward-and-backward recording runs the computation
on fake tensors that require grad (``autograd/joint.py``), and the fusion executor walks a
region's lines with FX nodes as the values to build the graph it hands Inductor
(``executors/fusion/fx_graph.py``). They subclass ``Interpreter`` and say what a line does with
``run_line``; reading arguments and binding outputs is shared:

    >>> class Count(Interpreter):
    ...     def run_line(self, index, bsym, args, kwargs):
    ...         self.lines = getattr(self, "lines", 0) + 1
    ...         return SKIP  # binds nothing
"""
from __future__ import annotations

from typing import Any

from torch.utils import _pytree as pytree

from .proxies import Proxy
from .symbols import BoundSymbol

SKIP = object()  # returned by ``run_line``: the line binds no outputs


class Interpreter:
    """Walks lines in order, keeping each proxy's value in ``env`` (name -> value)."""

    def __init__(self, env: dict[str, Any] | None = None):
        self.env: dict[str, Any] = {} if env is None else env

    def run(self, lines: list[BoundSymbol]) -> None:
        for index, bsym in enumerate(lines):
            args, kwargs = pytree.tree_map(self.read, (bsym.args, bsym.kwargs))
            out = self.run_line(index, bsym, args, kwargs)
            if out is not SKIP:
                self.bind(bsym.outputs, out)

    def run_line(self, index: int, bsym: BoundSymbol, args, kwargs):
        """What the line computes from its arguments (values, not proxies), or ``SKIP``."""
        raise NotImplementedError

    def read(self, x):
        """An argument's value: a proxy's from ``env``; slices read their bounds (pytree keeps a
        slice as one leaf); other values as ``constant`` says."""
        if isinstance(x, Proxy):
            return self.env[x.name]
        if type(x) is slice:
            return slice(self.read(x.start), self.read(x.stop), self.read(x.step))
        return self.constant(x)

    def constant(self, x):
        return x

    def bind(self, proxies, values) -> None:
        """Bind output proxies to values, matching tuples, lists and dicts element by element."""
        if isinstance(proxies, Proxy):
            self.bind_name(proxies.name, values)
        elif isinstance(proxies, (tuple, list)) and isinstance(values, (tuple, list)):
            for p, v in zip(proxies, values):
                self.bind(p, v)
        elif isinstance(proxies, dict) and isinstance(values, dict):
            for k in proxies:
                self.bind(proxies[k], values[k])

    def bind_name(self, name: str, value) -> None:
        self.env[name] = value
