"""The python executor's fast prologue: module structure cached, checks in straight lines.

The readable prologue walks the module tree on every call: it extracts each submodule, parameter
and buffer and checks each submodule's type. Only registering a module, parameter or buffer can
change what that walk finds, and PyTorch calls global registration hooks on every such
assignment (``register_module_{module,parameter,buffer}_registration_hook``). So the walk moves
into a function of its own, ``refresh_module_structure``, whose result is kept until a hook fires;
the prologue then only checks:

- the call's arguments and global state, as before;
- each module attribute the program read (``training``, ``eps``, a config object and its fields),
  by identity with the value it was compiled for, read straight from the module's ``__dict__``;
- all tensors' metadata, in one C++ call (``TensorGuards``).

A module attribute reassigned to an equal value therefore recompiles once: identity is the check
that is both exact and cheapest.

Not seen by the cached walk: ``del module.attr`` of a submodule, parameter or buffer, and writes
to ``module._parameters`` (or ``_buffers``, ``_modules``) that bypass ``nn.Module.__setattr__``.
Call ``keraunos.invalidate_module_structure()`` after doing either.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch._C._dynamo.guards import TensorGuards

from ..core.proxies import Proxy
from ..core.symbols import BoundSymbol, Code, GlueSymbol
from ..core.trace import Trace

# Replaced by a new object whenever a module, parameter or buffer is registered anywhere.
_tree_token: list[object] = [object()]


def invalidate_module_structure() -> None:
    """Make every jitted module walk its module tree again on its next call."""
    _tree_token[0] = object()


def _on_registration(module, name, value):
    _tree_token[0] = object()


torch.nn.modules.module.register_module_module_registration_hook(_on_registration)
torch.nn.modules.module.register_module_parameter_registration_hook(_on_registration)
torch.nn.modules.module.register_module_buffer_registration_hook(_on_registration)


def _lines_formatter(bsym, w):
    return bsym.info["lines"](w)


def _glue(name: str, lines) -> BoundSymbol:
    return BoundSymbol(GlueSymbol(name, _lines_formatter), info={"lines": lines}, executor="python")


def _tensor_guards(checks: list[BoundSymbol]):
    reals = [b.info["real"] for b in checks]
    return TensorGuards(*reals, dynamic_dims_sizes=[list(t.shape) for t in reals],
                        dynamic_dims_strides=[list(t.stride()) for t in reals])


def fast_prologue(trace: Trace) -> tuple[Trace, Trace | None]:
    """The fast prologue, and the trace of its module-structure walk (``None`` for functions)."""
    start = time.perf_counter()
    bsyms = trace.bound_symbols
    ret = bsyms[-1]
    structural_vars: dict[str, Any] = {}  # var name -> path, of values the cached walk extracts
    walk: list[BoundSymbol] = []
    rest: list[BoundSymbol] = []
    checks: list[BoundSymbol] = []
    for b in bsyms[:-1]:
        name = b.symbol.name
        path = b.info.get("path") if name == "unpack" else b.info.get("subject")
        if name == "check_tensor":
            checks.append(b)
        elif path is not None and not isinstance(path, str) and path.is_structural():
            walk.append(b)
            if name == "unpack":
                structural_vars[b.outputs.name] = path
        else:
            rest.append(b)
    if not walk:
        return _finish(trace, rest, checks, ret, None, [], [], start), None

    # Which structural values the rest of the prologue needs.
    params = list(ret.args[0])
    statics = [p for p in params if isinstance(p, Proxy) and p.name in structural_vars]
    attribute_parents = _attribute_parents(rest, structural_vars)
    uses_by_rest = _names_used([b for b in rest if not _is_dict_unpack(b, attribute_parents)]) | {
        v for v in _names_in(ret.args[1])}
    module_vars = [n for n in structural_vars if n in uses_by_rest and n not in
                   {p.name for p in statics}]
    dict_vars = [n for n in structural_vars if n in attribute_parents]
    static_names = [p.name for p in statics]
    token = "_tree_token"
    cache = [(None,)]

    def store(w):
        w.namespace["_structure"] = cache
        return [f"result = (token, {_tuple(static_names)}, "
                f"{_tuple([f'{n}.__dict__' for n in dict_vars])}, {_tuple(module_vars)})",
                "_structure[0] = result",
                "return result"]
    walk_trace = Trace("refresh_module_structure", [], [
        _glue("token", lambda w: [f"token = {token}[0]"])] + walk + [_glue("store", store)],
        list(trace.header) + ["Constructed by Cache Module Structure: the module tree walk, run "
                              "again only after a module, parameter or buffer is registered"],
        namespace={**trace.namespace, token: _tree_token})
    refresh = walk_trace.python_callable()

    def load(w):
        w.namespace.update({"_structure": cache, token: _tree_token,
                            "refresh_module_structure": refresh})
        lines = ["_s = _structure[0]",
                 f"if _s[0] is not {token}[0]:  # a module, parameter or buffer was registered",
                 "  _s = refresh_module_structure()",
                 "  if type(_s) is not tuple: return _s"]
        if static_names and _needs_locals(static_names, rest, checks, ret):
            lines.append(f"{_targets(static_names)} = _s[1]")
        if dict_vars:
            lines.append(f"{_targets(['_d_' + n for n in dict_vars])} = _s[2]")
        if module_vars:
            lines.append(f"{_targets(module_vars)} = _s[3]")
        return lines
    call_part = [b for b in rest if not _from_module(b)]
    module_part = [_fast_attribute(b, structural_vars, dict_vars) for b in rest if _from_module(b)]
    lines = call_part + [_glue("load module structure", load)] + module_part
    return _finish(trace, lines, checks, ret, "_s[1]", static_names, walk, start), walk_trace


def _from_module(b: BoundSymbol) -> bool:
    path = b.info.get("path") if b.symbol.name == "unpack" else b.info.get("subject")
    return path is not None and not isinstance(path, str) and path.is_module_derived()


def _is_dict_unpack(b: BoundSymbol, attribute_parents) -> bool:
    return (b.symbol.name == "unpack" and b.info["path"].kind == "attr"
            and b.args[0] in attribute_parents)


def _finish(trace, lines, checks, ret, statics_expr, static_names, walk, start) -> Trace:
    check_names = [b.args[0].name for b in checks]
    if checks:
        guards = _tensor_guards(checks)
        names = [b.info["path"] for b in checks]
        arg_list = _splice(check_names, static_names, statics_expr)

        def fused(w):
            g = w.constant(guards, "tensor_guards")
            n = w.constant(names, "tensor_names")
            return [f"if not {g}.check({arg_list}):",
                    f"  return {g}.check_verbose({arg_list}, tensor_check_names={n})"
                    f"  # {len(checks)} tensors checked in one C++ call"]
        lines = lines + [_glue("check tensors", fused)]
    inputs, pro_to_epi = ret.args
    input_names = [p.name for p in inputs]

    def returned(w):
        return [f"return ({_splice(input_names, static_names, statics_expr)},), "
                f"{w.value(tuple(pro_to_epi))}"]
    lines = lines + [_glue("return", returned)]
    return trace.derive(lines, "Fast Prologue (python executor)", time.perf_counter() - start)


def _splice(names: list[str], static_names: list[str], statics_expr: str | None) -> str:
    """``a, *_s[1], b`` when the static tensors appear in ``names`` as one run, in order."""
    if statics_expr and static_names:
        n = len(static_names)
        for i in range(len(names) - n + 1):
            if names[i:i + n] == static_names:
                return ", ".join(names[:i] + [f"*{statics_expr}"] + names[i + n:])
    return ", ".join(names)


def _needs_locals(static_names, rest, checks, ret) -> bool:
    used = _names_used(rest) | set(_names_in(ret.args[1]))
    if any(n in used for n in static_names):
        return True
    check_names = [b.args[0].name for b in checks]
    input_names = [p.name for p in ret.args[0]]
    return any(_splice(names, static_names, "_s[1]") == ", ".join(names)
               and any(n in names for n in static_names) for names in (check_names, input_names))


def _names_used(bsyms: list[BoundSymbol]) -> set[str]:
    used = set()
    for b in bsyms:
        used.update(p.name for p in b.input_proxies())
        used.update(x for x in b.args if isinstance(x, str))
        subject = b.info.get("path")
        if subject is not None and b.symbol.name == "unpack":
            pass
    return used


def _names_in(values) -> list[str]:
    out = []
    for v in values:
        if isinstance(v, Proxy):
            out.append(v.name)
        elif isinstance(v, Code):
            out.append(str(v))
    return out


def _attribute_parents(rest: list[BoundSymbol], structural_vars) -> set[str]:
    parents = set()
    for b in rest:
        if b.symbol.name == "unpack" and b.info["path"].kind == "attr":
            (parent,) = b.args
            if parent in structural_vars:
                parents.add(parent)
    return parents


def _fast_attribute(b: BoundSymbol, structural_vars, dict_vars) -> BoundSymbol:
    """An attribute read from a module's ``__dict__``; a value check by identity."""
    if b.symbol.name == "unpack" and b.info["path"].kind == "attr":
        (parent,) = b.args
        if parent in dict_vars:
            key = b.info["path"].key
            out = b.outputs.name
            return _glue("unpack", lambda w: [f"{out} = _d_{parent}[{key!r}]"])
        return b
    g = b.info.get("guard")
    if b.symbol.name == "check" and g is not None and g.kind in ("value", "identity") \
            and g.from_module and not hasattr(g.expected, "proxy"):
        subject_var = None
        index, description, expected = b.info["index"], b.info["description"], g.expected
        condition = b.info["condition"]

        def identity(w, condition=condition):
            # The subject variable is the one the original condition starts with.
            var = condition(w).split(" ", 1)[0].removeprefix("type(").rstrip(")")
            return [f"if {var} is not {w.constant(expected, 'expected')}: return {index}  "
                    f"# {description}"]
        return _glue("check", identity)
    return b


def _tuple(names: list[str]) -> str:
    if not names:
        return "()"
    return "(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")"


def _targets(names: list[str]) -> str:
    return ", ".join(names) + ("," if len(names) == 1 else "")
