"""The trace checker: what every trace must satisfy, checked on its bound symbols and on the
Python it generates (what runs), as ``torch.fx.Graph.lint`` does for a graph.

- every name a line reads is bound earlier: a parameter, an earlier line's output, or an object
  of the trace's namespace (``torch``, constants, glue runtimes);
- each name is bound once on the straight-line path (``a += b``, which rebinds ``a`` to itself,
  and a conditional update such as the fast prologue's ``if stale: _s = refresh()`` are allowed);
- nothing is read after its ``del``;
- the signature's parameters are distinct, and every proxy a line reads is bound earlier.

``Trace.lint()`` raises ``TraceLintError`` listing every problem with the line it is on. With
``KERAUNOS_LINT=1`` in the environment (the test suite sets it), every trace a pass makes and
every trace compiled to Python is checked.
"""
from __future__ import annotations

import ast
import builtins
import os
import threading

from .proxies import Proxy


class TraceLintError(AssertionError):
    """A trace breaks one of the rules above: a bug in the pass that made it."""


def enabled() -> bool:
    """``KERAUNOS_LINT=1``, on a user's thread. Not on keraunos's background thread: the check
    parses the trace's source, and CPython's parser is not safe to run on two threads at once
    ("AST constructor recursion depth mismatch", 3.11); the traces made there are checked at the
    switch to the fused tier, on the user's thread (``pipeline``)."""
    if getattr(threading.current_thread(), "keraunos_background", False):
        return False
    return os.environ.get("KERAUNOS_LINT", "0") not in ("", "0")


def problems(trace) -> list[str]:
    """Every rule the trace breaks, one sentence each."""
    found = _proxy_problems(trace)
    src, namespace = trace.source(executable=True)
    found += _source_problems(src, trace.name, namespace)
    return found


def check(trace) -> None:
    found = problems(trace)
    if found:
        listing = "\n".join(f"  - {p}" for p in found)
        raise TraceLintError(f"trace {trace.name!r} is malformed ({trace.header[-1:] or 'no header'}):"
                             f"\n{listing}\n--- the trace ---\n{trace}")


def _proxy_problems(trace) -> list[str]:
    """Def-use on the bound symbols: a line reads only proxies the signature, the namespace or
    an earlier line binds. (Lines a pass writes as Python, ``glue.PYTHON``, are checked on the
    source below.)"""
    found = []
    bound = set(trace.namespace)
    for p in trace.params:
        name = p.name if isinstance(p, Proxy) else str(p).lstrip("*")
        if name in bound - set(trace.namespace):
            found.append(f"parameter {name} appears twice in the signature")
        bound.add(name)
    for i, bsym in enumerate(trace.bound_symbols):
        for p in bsym.input_proxies():
            if p.name not in bound:
                found.append(f"line {i} ({bsym.symbol.name}) reads {p.name}, which nothing "
                             f"before it binds")
        bound.update(p.name for p in bsym.output_proxies())
    return found


def _source_problems(src: str, fn_name: str, namespace: dict) -> list[str]:
    tree = ast.parse(src)
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == fn_name), None)
    if fn is None:
        return [f"the source defines no function {fn_name}"]
    known = set(namespace) | set(dir(builtins))
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)]
    params += [a.arg for a in (fn.args.vararg, fn.args.kwarg) if a is not None]
    walker = _Walker(known, params)
    for stmt in fn.body:
        walker.statement(stmt)
    return walker.found


class _Walker:
    """Walks a generated function's statements in order, tracking the names bound so far."""

    def __init__(self, known: set[str], params: list[str]):
        self.known = known
        self.bound: set[str] = set(params)
        self.deleted: dict[str, int] = {}
        self.found: list[str] = []
        self.branch_depth = 0  # inside an if/for/while/try body: rebinding is an update
        if len(set(params)) != len(params):
            self.found.append(f"the signature repeats a parameter: {params}")

    def statement(self, stmt: ast.stmt) -> None:
        if isinstance(stmt, ast.AugAssign):  # `a += b` reads and rebinds a: no new binding
            self.reads(stmt.value)
            self.reads(stmt.target, load=True)
            return
        if isinstance(stmt, ast.Delete):
            for target in stmt.targets:
                for name in _names(target):
                    self.read(name, stmt.lineno)
                    self.bound.discard(name)
                    self.deleted[name] = stmt.lineno
            return
        if isinstance(stmt, (ast.If, ast.While)):
            self.reads(stmt.test)
            self.branch(stmt.body, stmt.orelse)
            return
        if isinstance(stmt, ast.For):
            self.reads(stmt.iter)
            self.branch_depth += 1
            self.bind(stmt.target, stmt.lineno)
            self.branch_depth -= 1
            self.branch(stmt.body, stmt.orelse)
            return
        if isinstance(stmt, (ast.With, ast.Try)):
            for item in getattr(stmt, "items", ()):
                self.reads(item.context_expr)
                if item.optional_vars is not None:
                    self.bind(item.optional_vars, stmt.lineno)
            if isinstance(stmt, ast.With):
                for s in stmt.body:
                    self.statement(s)
                return
            self.branch(stmt.body, stmt.orelse)
            for handler in stmt.handlers:
                self.branch_depth += 1
                if handler.name:  # `except E as e`: bound in its handler (and unbound after)
                    self.bind(ast.Name(handler.name, ast.Store()), handler.lineno)
                self.branch(handler.body)
                self.branch_depth -= 1
            for s in stmt.finalbody:
                self.statement(s)
            return
        if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)):  # a nested helper: its name only
            self.bound.add(stmt.name)
            return
        targets = []
        if isinstance(stmt, ast.Assign):
            targets = stmt.targets
            self.reads(stmt.value)
        elif isinstance(stmt, ast.AnnAssign):
            targets = [stmt.target]
            if stmt.value is not None:
                self.reads(stmt.value)
        else:
            self.reads(stmt)
        for target in targets:
            self.bind(target, stmt.lineno)

    def branch(self, *bodies) -> None:
        self.branch_depth += 1
        for body in bodies:
            for s in body:
                self.statement(s)
        self.branch_depth -= 1

    def bind(self, target: ast.expr, lineno: int) -> None:
        if not isinstance(target, (ast.Name, ast.Tuple, ast.List, ast.Starred)):
            self.reads(target, load=True)  # `x[i] = v`, `obj.a = v`: reads x and obj
            return
        for name in _names(target):
            if name == "_":
                continue
            if name in self.bound and not self.branch_depth:
                self.found.append(f"source line {lineno}: {name} is bound a second time")
            self.bound.add(name)
            self.deleted.pop(name, None)
        for sub in ast.walk(target):  # subscripts inside a pattern read their containers
            if isinstance(sub, (ast.Subscript, ast.Attribute)):
                self.reads(sub, load=True)

    def reads(self, node: ast.AST, load: bool = False) -> None:
        local = _scoped_names(node)
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and (load or isinstance(sub.ctx, ast.Load)) \
                    and sub.id not in local:
                self.read(sub.id, sub.lineno)

    def read(self, name: str, lineno: int) -> None:
        if name in self.bound or name in self.known:
            return
        if name in self.deleted:
            self.found.append(f"source line {lineno}: reads {name} after its del on line "
                              f"{self.deleted[name]}")
        else:
            self.found.append(f"source line {lineno}: reads {name} before anything binds it")


def _names(target: ast.expr) -> list[str]:
    return [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]


def _scoped_names(node: ast.AST) -> set[str]:
    """Names bound inside lambdas and comprehensions within ``node``: local to them."""
    local = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Lambda):
            local.update(a.arg for a in (*sub.args.posonlyargs, *sub.args.args,
                                         *sub.args.kwonlyargs))
            local.update(a.arg for a in (sub.args.vararg, sub.args.kwarg) if a is not None)
        elif isinstance(sub, ast.comprehension):
            local.update(_names(sub.target))
        elif isinstance(sub, ast.NamedExpr):
            local.add(sub.target.id)
    return local
