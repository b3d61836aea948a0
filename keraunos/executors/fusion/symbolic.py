"""Regions of entries compiled with symbolic sizes (``cache="symbolic values"``, automatic dynamic).

Such a region is compiled once for every size its entry serves: its fake inputs carry the
capture's own ``SymInt`` sizes (the same ``ShapeEnv``), the symbols it reads as Python ints
(``t.view(s0, -1, 4)``) are inputs of its graph, and a size expression in an argument
(``2*s0``) becomes graph nodes over them. Inductor then generates code that reads the sizes at
run time. What the entry's prologue checks is all a kernel may assume, so:

- a region is compiled on a private copy of the capture's ``ShapeEnv`` (``private_copy``): facts
  about the sizes that its compile records beyond the prologue's (a guard Inductor took,
  ``s0 <= 4096``; a narrower range; a replacement) become the kernel's ``guards``: each call
  checks them (a Python expression of the call's sizes) and, where one fails, runs the region's
  own lines instead (the torch executor's ops, exact); a region whose guards read a size that its
  inputs do not give runs on the next executor;
- the key of a symbolic region holds the facts of its ``ShapeEnv`` before the entry's first
  compile (``baseline``: ranges, divisibility, replacements, guards), so that the layers of an
  entry, and entries with the same facts, share kernels;
- layouts (strides) are compared at run time by evaluating the traced expressions with the sizes
  of the call (``Layout``).
"""
from __future__ import annotations

import copy
import math
import operator

import sympy
import torch

SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


def is_symbolic(value) -> bool:
    return isinstance(value, SYM_TYPES)


def backed(value) -> bool:
    """A symbolic size the prologue binds (not one that depends on tensor data)."""
    from ...torch_internals.fake import free_unbacked_symbols
    return not free_unbacked_symbols(value)


def shape_env_of(values):
    """The ``ShapeEnv`` of the first symbolic value among ``values`` (None when all are ints)."""
    for v in values:
        if is_symbolic(v):
            return v.node.shape_env
    return None


# sympy node type -> the Python operator that computes it on ints (and SymInts, in a graph).
def _binary(op):
    def build(graph, args):
        result = args[0]
        for a in args[1:]:
            result = graph.call_function(op, (result, a))
        return result
    return build


def _expression_builders():
    from ...torch_internals.fake import FloorDiv, Max, Min, Mod, PythonMod
    return {
        sympy.Add: _binary(operator.add),
        sympy.Mul: _binary(operator.mul),
        FloorDiv: _binary(operator.floordiv),
        PythonMod: _binary(operator.mod),
        Mod: _binary(operator.mod),
        Max: _binary(torch.sym_max),
        Min: _binary(torch.sym_min),
    }


def expression_supported(expr) -> bool:
    """Whether ``expression_node`` can build ``expr`` (integers, symbols and the operators above,
    with non-negative integer powers)."""
    if expr.is_Integer or expr.is_Symbol:
        return True
    if isinstance(expr, sympy.Pow):
        return expr.exp.is_Integer and int(expr.exp) >= 1 and expression_supported(expr.base)
    return type(expr) in _expression_builders() and all(expression_supported(a)
                                                        for a in expr.args)


def expression_node(graph, expr, symbol_nodes: dict):
    """FX nodes computing ``expr`` from the nodes of its symbols (an int when it has none)."""
    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        return symbol_nodes[expr]
    if isinstance(expr, sympy.Pow):
        base = expression_node(graph, expr.base, symbol_nodes)
        return _binary(operator.mul)(graph, [base] * int(expr.exp))
    args = [expression_node(graph, a, symbol_nodes) for a in expr.args]
    return _expression_builders()[type(expr)](graph, args)


def facts(shape_env) -> tuple:
    """What a ``ShapeEnv`` knows about its sizes: what compiled code may rely on, and what a
    region's compile must not add to."""
    ranges = tuple(sorted((str(s), str(r.lower), str(r.upper))
                          for s, r in shape_env.var_to_range.items()))
    return (ranges, tuple(sorted(map(str, shape_env.divisible))),
            tuple(sorted((str(k), str(v)) for k, v in shape_env.replacements.items())),
            tuple(str(g.expr) for g in shape_env.guards))


def baseline(shape_env) -> tuple:
    """The facts of ``shape_env`` before the first region of its entry was compiled: what the
    entry's prologue checks. Kept on the ``ShapeEnv``, since compiles add to its facts."""
    found = getattr(shape_env, "_keraunos_fusion_baseline", None)
    if found is None:
        found = (facts(shape_env), len(shape_env.guards), dict(shape_env.var_to_range),
                 dict(shape_env.replacements), set(shape_env.divisible))
        shape_env._keraunos_fusion_baseline = found
    return found


def private_copy(shape_env):
    """A copy of ``shape_env`` for one region's compile: the facts Inductor records while
    compiling go to it, not to the capture's, whose facts the entry's prologue checks (with
    Inductor's, a call outside them would miss the entry and recompile instead of running the
    region's own lines). Its baseline is its state as copied."""
    copied = copy.deepcopy(shape_env)
    copied.__dict__.pop("_keraunos_fusion_baseline", None)
    baseline(copied)
    return copied


def moved(value, shape_env):
    """``value`` (an int or a ``SymInt`` of another ``ShapeEnv``) as a ``SymInt`` of ``shape_env``:
    the same expression, the same hint."""
    if not isinstance(value, torch.SymInt):
        return value
    from torch.fx.experimental.sym_node import SymNode
    return torch.SymInt(SymNode(value.node.expr, shape_env, int, value.node.hint))


def added_facts(shape_env) -> list:
    """What the ``ShapeEnv`` knows beyond its baseline, as boolean expressions over the size
    symbols: guards Inductor recorded, narrower ranges, replacements, divisibility."""
    _, n_guards, ranges, replacements, divisible = baseline(shape_env)
    added = [g.expr for g in shape_env.guards[n_guards:]]
    for s, r in shape_env.var_to_range.items():
        before = ranges.get(s)
        if before is not None and before == r:
            continue
        if r.lower.is_finite and (before is None or r.lower != before.lower):
            added.append(sympy.Ge(s, r.lower))
        if r.upper.is_finite and (before is None or r.upper != before.upper):
            added.append(sympy.Le(s, r.upper))
    added += [sympy.Eq(s, e) for s, e in shape_env.replacements.items()
              if replacements.get(s) != e]
    added += [sympy.Eq(e, 0) for e in shape_env.divisible - divisible]
    return [e for e in added if e is not sympy.true]


def guard_function(conditions: list, layout: "Layout"):
    """A Python function of the bound sizes (in ``layout``'s order) that is true when every
    condition holds, and its source; None when a condition reads a size the region's inputs do
    not give."""
    from ...core.symbolic import print_expression
    names = {symbol: f"v{k}" for k, (_, _, symbol) in enumerate(layout.binders)}
    if any(not e.free_symbols <= set(names) for e in conditions):
        return None
    body = " and ".join(f"({print_expression(e, names)})" for e in dict.fromkeys(conditions))
    source = f"lambda {', '.join(names.values())}: {body or 'True'}"
    # The printer writes math.ceil / math.floor / math.trunc and max / min.
    namespace = {"max": max, "min": min, "math": math}
    return eval(source, namespace), source  # noqa: S307 - our own expressions


def readable(conditions: list, names: dict) -> str:
    """The conditions in the trace's names (``s0``), without repeats."""
    from ...core.symbolic import print_expression
    return " and ".join(dict.fromkeys(print_expression(e, names) for e in conditions))


def expr_of(value):
    return value.node.expr if is_symbolic(value) else value


class Layout:
    """Evaluates traced sizes and strides (expressions of size symbols) for one call, with the
    symbols bound from the call's own tensors' sizes and int inputs."""

    def __init__(self, inputs):
        self.binders = []  # (input position, dim or None, symbol), one per symbol
        bound = set()
        for k, p in enumerate(inputs):
            if hasattr(p, "shape"):
                places = [(d, expr_of(size)) for d, size in enumerate(p.shape)
                          if is_symbolic(size) and expr_of(size).is_Symbol]
            else:
                # (a float symbol is no size: the kernel takes it as a tensor, its stand-in)
                places = [(None, p.symbol)] if getattr(p, "symbol", None) is not None and \
                    getattr(p, "python_type", int) is not float else []
            for d, symbol in places:
                if symbol not in bound:
                    bound.add(symbol)
                    self.binders.append((k, d, symbol))
        # Symbols read only from tensor sizes: the graph gets them as int inputs of its own,
        # after the region's, as Dynamo gives Inductor every size symbol (Inductor's caches
        # record and check their guards only on such inputs).
        numbers = {getattr(p, "symbol", None) for p in inputs if not hasattr(p, "shape")}
        self.extra = [(k, d, symbol) for k, d, symbol in self.binders if symbol not in numbers]
        sizes = [expr_of(v) for p in inputs if hasattr(p, "shape") for v in (*p.shape, *p.stride)]
        self.unbound = set().union(*(e.free_symbols for e in sizes if hasattr(e, "free_symbols")))
        self.unbound -= bound

    def extra_values(self, args) -> list[int]:
        return [args[k].size(d) for k, d, _ in self.extra]

    def evaluator(self, values):
        """A function of the bound sizes (``values(args)``) that gives ``values`` (ints and
        SymInts) as ints, compiled once (the backward's incoming gradients are checked on every
        call); None when one reads a size that is not bound."""
        import math

        from ...core.symbolic import print_expression
        names = {symbol: f"v{k}" for k, (_, _, symbol) in enumerate(self.binders)}
        exprs = [expr_of(v) for v in values]
        if any(not getattr(e, "free_symbols", set()) <= set(names) for e in exprs):
            return None
        items = [print_expression(e, names) if is_symbolic(v) else repr(v)
                 for e, v in zip(exprs, values)]
        body = f"({', '.join(items)},)" if items else "()"  # a 0-dim tensor: no sizes at all
        source = f"lambda {', '.join(names.values())}: {body}"
        return eval(source, {"max": max, "min": min, "math": math})  # noqa: S307

    def values(self, args) -> list[int]:
        return [args[k] if d is None else args[k].size(d) for k, d, _ in self.binders]
