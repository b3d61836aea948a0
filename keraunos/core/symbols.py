"""Symbols and bound symbols: the operations of a trace and the lines that apply them.

A ``Symbol`` is an operation: a torch function, a tensor method, an operator, or a piece of glue
of our own (a prologue check, an epilogue write-back). A ``BoundSymbol`` is one line of a trace:
the symbol applied to arguments (proxies and constants, possibly nested in lists, tuples and dicts),
the proxies it defines, the user source line it came from, its tags, and optionally its
``subsymbols`` (a decomposition into lower-level operations, for passes that want one).
Glue symbols, the lines of our own, are defined in ``glue.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from . import tree
from .code import Code
from .proxies import Proxy
from ..torch_internals.dispatch import OpOverload
from .tags import Tag


@dataclass(frozen=True)
class Source:
    """Where in the user's code an operation came from."""

    filename: str
    lineno: int
    code: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno}: {self.code}"


class Symbol:
    """An operation. Subclasses say how a line applying it reads (and runs) as Python."""

    name: str = "symbol"

    def format(self, bsym: "BoundSymbol", w: "CodeWriter") -> list[str]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


_BINARY = {
    "add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%", "pow": "**",
    "matmul": "@", "and": "&", "or": "|", "xor": "^", "lshift": "<<", "rshift": ">>",
    "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
}
_UNARY = {"neg": "-", "pos": "+", "invert": "~"}


class TorchSymbol(Symbol):
    """A torch-level operation, printed the way the user would write it.

    ``style`` is one of ``function`` (``torch.nn.functional.linear(x, w)``), ``method``
    (``x.view(2, 3)``), ``operator`` (``a + b``), ``getter`` (``x.T``), ``getitem`` and ``setitem``.
    """

    def __init__(self, fn: Callable, name: str, style: str):
        self.fn = fn
        self.name = name
        self.style = style

    @property
    def attribute(self) -> Any:
        """What a getter reads, to compare by identity (``symbol.attribute is torch.Tensor.grad``):
        the descriptor whose ``__get__`` its ``fn`` is (a new method-wrapper on every read, so
        ``fn`` itself cannot be compared). ``None`` for the other styles."""
        return getattr(self.fn, "__self__", None) if self.style == "getter" else None

    def expression(self, bsym: "BoundSymbol", w: "CodeWriter") -> str:
        args, kwargs = bsym.args, bsym.kwargs
        if self.style == "function":
            return f"{w.callee(self)}({w.call_arguments(args, kwargs)})"
        if self.style == "opaque":  # a callable with no public torch name: called from the namespace
            return f"{w.constant(self.fn, self.name)}({w.call_arguments(args, kwargs)})"
        if self.style == "method":
            return f"{w.value(args[0])}.{self.name}({w.call_arguments(args[1:], kwargs)})"
        if self.style == "getter":
            return f"{w.value(args[0])}.{self.name}"
        if self.style in ("getitem", "setitem"):
            return f"{w.value(args[0])}[{w.index(args[1])}]"
        if self.style == "operator":
            dunder = self.name.strip("_")
            if dunder in _UNARY:
                return f"{_UNARY[dunder]}{w.value(args[0])}"
            if dunder == "abs":
                return f"abs({w.value(args[0])})"
            reflected = dunder.startswith("r") and dunder[1:] in _BINARY
            inplace = dunder.startswith("i") and dunder[1:] in _BINARY
            op = _BINARY[dunder[1:] if (reflected or inplace) else dunder]
            lhs, rhs = (args[1], args[0]) if reflected else (args[0], args[1])
            return f"{w.value(lhs)} {op}{'=' if inplace else ''} {w.value(rhs)}"
        raise AssertionError(self.style)

    def format(self, bsym, w):
        expr = self.expression(bsym, w)
        if self.style == "setitem":
            return [f"{expr} = {w.value(bsym.args[2])}"]
        comment = f"  # {bsym.comment}" if bsym.comment else ""
        if self.style == "operator" and self.name.strip("_")[0] == "i" and self.name.strip("_")[1:] in _BINARY:
            return [expr + comment]  # `a += b` rebinds a to itself
        return [w.assignment(bsym, expr) + comment]


@dataclass
class BoundSymbol:
    """One line of a trace."""

    symbol: Symbol
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    outputs: Any = None
    source: Source | None = None
    tags: set[Tag] = field(default_factory=set)
    subsymbols: list["BoundSymbol"] = field(default_factory=list)
    executor: str | None = None
    # A glue line's typed record (``glue.Unpack``, ``glue.CheckTensor``, ...); None otherwise.
    fields: Any = None
    comment: str | None = None  # printed after the line: why it is there
    # The module calls the line was recorded in, outermost first: (qualified name, class) pairs,
    # as torch.fx's ``nn_module_stack`` (``(("h.3", Block), ("h.3.attn", Attention))``).
    module_stack: tuple = ()

    def input_proxies(self) -> list[Proxy]:
        leaves = tree.leaves((self.args, self.kwargs))
        return [x for x in leaves if isinstance(x, Proxy)]

    def output_proxies(self) -> list[Proxy]:
        return [x for x in tree.leaves(self.outputs) if isinstance(x, Proxy)]

    def replace(self, **changes) -> "BoundSymbol":
        fields = dict(symbol=self.symbol, args=self.args, kwargs=self.kwargs, outputs=self.outputs,
                      source=self.source, tags=set(self.tags), subsymbols=list(self.subsymbols),
                      executor=self.executor, fields=self.fields, comment=self.comment,
                      module_stack=self.module_stack)
        fields.update(changes)
        return BoundSymbol(**fields)

    def substitute(self, mapping: dict[str, Proxy]) -> "BoundSymbol":
        """This line with its input proxies renamed by ``mapping`` (name -> proxy)."""
        def swap(x):
            return mapping.get(x.name, x) if isinstance(x, Proxy) else x
        args, kwargs = tree.map_leaves(swap, (self.args, self.kwargs))
        return self.replace(args=args, kwargs=kwargs)


def direct_entry(fn: Any) -> Callable | None:
    """The C++ entry point an ATen overload's call forwards to, or ``None`` for anything else.

    ``OpOverload.__call__`` is one Python frame that calls ``fn._op`` with the same arguments;
    ``_op`` itself handles torch function modes, subclasses' ``__torch_function__``, dispatch modes
    and autograd, and modes still see the ``OpOverload``. Calling it directly saves that frame and
    the ``torch.ops.aten.X.Y`` lookups (about 1.5 us per op, hundreds of ops per training step).
    Subclasses that override ``__call__`` (TorchBind ops) keep their own call."""
    overload = OpOverload
    if isinstance(fn, overload) and type(fn).__call__ is overload.__call__:
        return getattr(fn, "_op", None)
    return None


class CodeWriter:
    """Turns values into Python source, collecting the objects the source needs in ``namespace``.

    ``executable``: the source is the one that runs (``Trace.python_callable``), where an ATen
    overload is called through its bound entry point (``direct_entry``); the printed trace
    spells it ``torch.ops.aten.X.Y`` and is otherwise the same program."""

    def __init__(self, namespace: dict[str, Any], executable: bool = False):
        self.namespace = namespace
        self.executable = executable
        self.defined: set[str] = set()
        self._constant_names: dict[int, str] = {}

    def callee(self, symbol: TorchSymbol) -> str:
        """How a line calls a function-style torch symbol: its name, or in the executable source
        the bound entry point of an ATen overload."""
        entry = direct_entry(symbol.fn) if self.executable else None
        if entry is None:
            return symbol.name
        return self.constant(entry, symbol.name.removeprefix("torch.ops."))

    def constant(self, obj: Any, hint: str = "c") -> str:
        key = id(obj)
        name = self._constant_names.get(key)
        if name is None:
            hint = "".join(c if c.isalnum() or c == "_" else "_" for c in hint)
            name = f"_{hint}{len(self._constant_names)}"
            self._constant_names[key] = name
            self.namespace[name] = obj
        return name

    def value(self, v: Any) -> str:
        if isinstance(v, Proxy):
            return v.name
        if isinstance(v, Code):
            return str(v)
        if v is None or isinstance(v, (bool, int, str)) and type(v) in (bool, int, str):
            return repr(v)
        if type(v) is float:
            if v != v:
                return "float('nan')"
            if v in (float("inf"), float("-inf")):
                return f"float('{v}')"
            return repr(v)
        if type(v) is complex:
            return repr(v)
        if isinstance(v, torch.dtype):
            return str(v)
        if isinstance(v, torch.device):
            return f"torch.device({str(v)!r})"
        if isinstance(v, torch.Size):
            return f"torch.Size({self.value(list(v))})"
        if type(v) is tuple:
            inner = ", ".join(self.value(x) for x in v)
            return f"({inner},)" if len(v) == 1 else f"({inner})"
        if type(v) is list:
            return "[" + ", ".join(self.value(x) for x in v) + "]"
        if type(v) is dict:
            return "{" + ", ".join(f"{self.value(k)}: {self.value(x)}" for k, x in v.items()) + "}"
        if type(v) is slice:
            return f"slice({self.value(v.start)}, {self.value(v.stop)}, {self.value(v.step)})"
        if v is Ellipsis:
            return "..."
        if isinstance(v, (torch.memory_format, torch.layout)):
            return str(v)
        return self.constant(v)

    def index(self, idx: Any) -> str:
        def one(i):
            if type(i) is slice:
                parts = ["" if p is None else self.value(p) for p in (i.start, i.stop, i.step)]
                return f"{parts[0]}:{parts[1]}" + (f":{parts[2]}" if parts[2] else "")
            return self.value(i)
        if type(idx) is tuple:
            if not idx:
                return "()"
            return ", ".join(one(i) for i in idx) + ("," if len(idx) == 1 else "")
        return one(idx)

    def call_arguments(self, args, kwargs) -> str:
        parts = [self.value(a) for a in args]
        parts += [f"{k}={self.value(v)}" for k, v in kwargs.items()]
        return ", ".join(parts)

    def target(self, outputs: Any) -> str | None:
        """The left-hand side that binds ``outputs``; ``None`` when nothing new is bound."""
        if isinstance(outputs, Proxy):
            return None if outputs.name in self.defined else outputs.name
        leaves = pytree.tree_leaves(outputs)
        if not any(isinstance(x, Proxy) and x.name not in self.defined for x in leaves):
            return None

        def pattern(o):
            if isinstance(o, Proxy):
                return o.name if o.name not in self.defined else "_"
            if isinstance(o, (tuple, list)):
                inner = ", ".join(pattern(x) for x in o)
                return f"({inner},)" if len(o) == 1 else f"({inner})"
            return "_"
        if isinstance(outputs, (tuple, list)):
            return pattern(outputs)[1:-1].rstrip(",") + ("," if len(outputs) == 1 else "")
        return "_"

    def assignment(self, bsym: BoundSymbol, expr: str) -> str:
        lhs = self.target(bsym.outputs)
        described = [p for p in bsym.output_proxies() if p.name not in self.defined and p.describe()]
        comment = ""
        if described:
            comment = "  # " + ", ".join(f"{p.name}: {p.describe()}" for p in described)
        return (f"{lhs} = {expr}" if lhs else expr) + comment
