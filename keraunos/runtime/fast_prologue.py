"""The fast prologue: the readable prologue rewritten so that a cache hit costs little.

The readable prologue walks the module tree on every call: it extracts each submodule, parameter
and buffer and checks each submodule's type. That walk moves into a function of its own,
``refresh_module_structure``, whose result is kept until the module-structure token
(``keraunos/runtime/structure.py``) changes; the prologue then only checks:

- the call's arguments and global state, as before;
- each module attribute the program read (``training``, ``eps``, a config object and its fields),
  by identity with the value it was compiled for, read straight from the module's ``__dict__``,
  one Python line each (``if _attribute_dicts[0]['training'] is not True: return 7``): dynamo's
  C++ guard tree over the same dicts costs as much per attribute, plus 2k instructions a call;
- all tensors' metadata, in one C++ call (``TensorGuards``, or dynamo's guard tree from a few
  tensors on: see ``guard_trees.py``), which also tells inference mode apart: its own check is
  dropped where there is such a call (``capture/ambient.py`` says why).

A module attribute reassigned to an equal value therefore recompiles once: identity is the check
that is both exact and cheapest.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


from ..core.provenance import root
from ..core import glue
from ..core.glue import CHECK, CHECK_TENSOR, UNPACK
from ..core.proxies import Proxy
from ..core.symbols import BoundSymbol, Code
from ..core.tags import AFTER_STRUCTURE
from ..core.runner import trace_step
from ..core.trace import Trace
from .structure import _tree_token, hook_state, watch_modules
from .guard_trees import TensorTree, tensor_guards


def _glue(label: str, lines, binds=None) -> BoundSymbol:
    """A line the pass writes as Python; ``binds``: the proxies its text binds, if any."""
    return glue.PYTHON.bind(label=label, lines=lines, outputs=binds, executor="python")


def _subject(b: BoundSymbol):
    """The path of the value a prologue line unpacks or checks, if it is about one."""
    return getattr(b.fields, "subject", None)


@dataclass
class _Parts:
    """The readable prologue's lines, sorted by where the fast prologue puts them."""

    walk: list[BoundSymbol] = field(default_factory=list)    # unpacks and checks of the tree
    rest: list[BoundSymbol] = field(default_factory=list)    # the call's and module attributes'
    checks: list[BoundSymbol] = field(default_factory=list)  # tensor metadata: one C++ call
    late: list[BoundSymbol] = field(default_factory=list)    # need every tensor (data reads)
    structural_vars: dict[str, Any] = field(default_factory=dict)  # var name -> path, walked


def _sort_lines(trace: Trace) -> _Parts:
    parts = _Parts()
    if trace.namespace.get("module") is not None:
        parts.structural_vars["module"] = root("module")
    for b in trace.bound_symbols[:-1]:
        path = _subject(b)
        if AFTER_STRUCTURE in b.tags:
            parts.late.append(b)
        elif b.symbol is CHECK_TENSOR:
            parts.checks.append(b)
        elif path is not None and all(
                p.is_structural() for p in getattr(b.fields, "paths", (path,))):
            parts.walk.append(b)
            if b.symbol is UNPACK:
                parts.structural_vars[b.outputs.name] = path
        else:
            parts.rest.append(b)
    return parts


@dataclass(frozen=True, eq=False)
class Spliced:
    """Among the inputs a fast prologue returns: the module's static tensors, as the kept walk
    holds them (``*_s[1]``), in their order."""

    expression: str  # what holds them, as the prologue reads it

    def __str__(self) -> str:
        return f"*{self.expression}"


STATICS = Spliced("_s[1]")


def inputs_code(items) -> str:
    """Inputs as call arguments: ``x, *_s[1], s0``."""
    return ", ".join(map(str, items))


@dataclass(frozen=True, eq=False)
class ModuleWalk:
    """A fast prologue's walk of the module tree: ``trace`` (``refresh_module_structure``), run
    again only when the module-structure token changes, its last result kept in ``cache``, and
    the hooks the program was compiled with (what it checks of them)."""

    trace: Trace
    cache: list
    hooks: tuple


@dataclass(frozen=True, eq=False)
class FastPrologue:
    """What the fast prologue pass made of a readable prologue, as data: the prologue a hit runs
    (``trace``), the walk it keeps (None for a function's), and what its last line returns, in
    order: ``inputs``, each a name the prologue binds or ``STATICS``, and ``pro_to_epi``.
    The hit paths (``hit_path.py``, ``native/``) and rebinding read this record, never the
    printed code."""

    readable: Trace
    trace: Trace
    walk: ModuleWalk | None
    inputs: tuple
    pro_to_epi: tuple

    @property
    def traces(self) -> list[Trace]:
        """The traces it adds to an entry's prologue traces, in order."""
        return ([self.walk.trace] if self.walk is not None else []) + [self.trace]


@trace_step
def fast_prologue(trace: Trace) -> FastPrologue:
    """The fast prologue of the readable prologue ``trace``."""
    ret = trace.bound_symbols[-1]
    parts = _sort_lines(trace)
    walk, rest, checks, late = parts.walk, parts.rest, parts.checks, parts.late
    if not walk:
        return _finish(trace, rest + late, checks, ret, None, [], None)

    # Which structural values the rest of the prologue needs.
    structural_vars = parts.structural_vars
    statics = [p for p in ret.args[0] if isinstance(p, Proxy) and p.name in structural_vars]
    static_names = [p.name for p in statics]
    attribute_parents = _attribute_parents(rest, structural_vars)
    uses_by_rest = _names_used([b for b in rest if not _is_dict_unpack(b, attribute_parents)]) | {
        v for v in _names_in(ret.args[1])} | _names_used(late)
    module_vars = [n for n in structural_vars if n in uses_by_rest and n not in static_names]
    dict_vars = [n for n in structural_vars if n in attribute_parents]
    keep = {p.name for p in ret.args[0]} | set(_names_in(ret.args[1])) | {
        b.args[0].name for b in checks} | _names_used(late)
    module_part, entries, object_dicts = _module_attributes(
        [b for b in rest if _from_module(b)], dict_vars, keep)
    cache = [(None,)]  # the walk's last result
    hooks = hook_state(trace.namespace["module"])
    walk_trace = _walk_trace(trace, walk, cache, hooks, (static_names, dict_vars, object_dicts,
                                                         module_vars))
    refresh = walk_trace.python_callable()
    module_part = _attribute_lines(module_part, entries, keep)
    bound_statics = bool(static_names) and _needs_locals(static_names, rest + late, checks, ret)
    walked = {b.outputs.name: b.outputs for b in walk if isinstance(b.outputs, Proxy)}
    binds = (statics if bound_statics else []) + [walked[n] for n in module_vars if n in walked]
    load = _glue("load module structure", LoadStructure(
        cache, refresh, tuple(static_names if bound_statics else ()), bool(dict_vars),
        tuple(module_vars)), binds=tuple(binds))
    lines = [b for b in rest if not _from_module(b)] + [load]
    lines += module_part + late
    return _finish(trace, lines, checks, ret, STATICS, static_names,
                   ModuleWalk(walk_trace, cache, hooks))


_TOKEN = "_tree_token"  # the name the walk and the load read the module-structure token by


def _walk_trace(trace: Trace, walk, cache, hooks, kept) -> Trace:
    """``refresh_module_structure``: the module tree walk, whose result the prologue keeps in
    ``cache`` until the tree changes: ``(token, static tensors, attribute dicts, module vars)``.
    ``kept``: the names of those tensors, the modules whose dicts are read, the ``__dict__``s of
    objects checked by identity, and the walked values the rest of the prologue reads."""
    static_names, dict_vars, object_dicts, module_vars = kept

    def store(w):
        w.namespace["_structure"] = cache
        dicts = _tuple([f"{n}.__dict__" for n in dict_vars])
        if object_dicts:
            dicts = f"{dicts} + {w.constant(tuple(object_dicts), 'object_dicts')}"
        modules = ["module"] + [b.outputs.name for b in walk if b.symbol is UNPACK
                                and b.fields.path.is_submodule]
        w.namespace["watch_modules"] = watch_modules
        return [f"watch_modules({_tuple(modules)})",
                f"result = (token, {_tuple(static_names)}, {dicts}, {_tuple(module_vars)})",
                "_structure[0] = result",
                "return result"]

    def check_hooks(w):
        w.namespace["hook_state"] = hook_state
        return [f"if hook_state(module) != {w.constant(hooks, 'compiled_hooks')}:",
                "  return 'a forward or backward hook was added or removed since compiling'"]
    return Trace("refresh_module_structure", [], [
        _glue("token", lambda w: [f"token = {_TOKEN}[0]"])] + walk + [
        _glue("check hooks", check_hooks), _glue("store", store)],
        list(trace.header) + ["Constructed by Cache Module Structure: the module tree walk, run "
                              "again only after a module, parameter or buffer is registered"],
        namespace={**trace.namespace, _TOKEN: _tree_token})


@dataclass(frozen=True, eq=False)
class LoadStructure:
    """The line that takes the kept walk (``cache``), walking again first (``refresh``) when the
    module-structure token changed; ``static_names``: the static tensors bound as locals (none
    when they are spliced in); whether module attributes are read from the kept ``__dict__``s;
    the walked values the rest of the prologue reads."""

    cache: list
    refresh: Any
    static_names: tuple
    dicts: bool
    module_vars: tuple
    tree_token: list = field(default_factory=lambda: _tree_token)  # what the walk is compared with

    def __call__(self, w) -> list[str]:
        w.namespace.update({"_structure": self.cache, _TOKEN: self.tree_token,
                            "refresh_module_structure": self.refresh})
        lines = ["_s = _structure[0]",
                 f"if _s[0] is not {_TOKEN}[0]:  # the module tree changed",
                 "  _s = refresh_module_structure()",
                 "  if type(_s) is not tuple: return _s"]
        if self.static_names:
            lines.append(f"{_targets(self.static_names)} = _s[1]")
        if self.dicts:
            lines.append("_attribute_dicts = _s[2]")
        if self.module_vars:
            lines.append(f"{_targets(self.module_vars)} = _s[3]")
        return lines


def _from_module(b: BoundSymbol) -> bool:
    path = _subject(b)
    return path is not None and path.is_module_derived()


def _is_dict_unpack(b: BoundSymbol, attribute_parents) -> bool:
    return (b.symbol is UNPACK and b.fields.path.is_attr
            and b.args[0].name in attribute_parents)


def _finish(trace, lines, checks, ret, statics: Spliced | None, static_names,
            walk: ModuleWalk | None) -> FastPrologue:
    check_names = [b.args[0].name for b in checks]
    if checks:
        implied = [b for b in lines if _implied_by_tensor_checks(b)]
        lines = [b for b in lines if not _implied_by_tensor_checks(b)]
        fused = TensorChecks(tensor_guards(checks), check_names, checks, implied,
                             inputs_code(_splice(check_names, static_names, statics)))
        lines = lines + [_glue("check tensors", fused)]
    inputs, pro_to_epi = ret.args
    spliced = _splice([p.name for p in inputs], static_names, statics)
    returned = ReturnInputs(spliced, tuple(pro_to_epi))
    lines = lines + [_glue("return", returned)]
    return FastPrologue(trace, trace.derive(lines, "Fast Prologue (python executor)"), walk,
                        spliced, tuple(pro_to_epi))


@dataclass(frozen=True, eq=False)
class TensorChecks:
    """The line that checks every tensor's metadata in one C++ call: ``guards`` (a
    ``TensorGuards``, or a ``TensorTree`` from ``TREE_FROM`` tensors on) over the tensors named
    ``checked``, written as ``arg_list``; the native hit path (``keraunos/runtime/native``) calls the same
    ``guards``."""

    guards: Any
    checked: list[str]
    checks: list[BoundSymbol]
    implied: list[BoundSymbol]  # ambient checks the tensor checks stand in for
    arg_list: str

    def __call__(self, w) -> list[str]:
        guards, checks, arg_list = self.guards, self.checks, self.arg_list
        g = w.constant(guards, "tensor_guards")
        if isinstance(guards, TensorTree):  # one tuple: ``check((x, w))``
            checked = f"({arg_list},)"
            reason = f"{g}.reason({checked})"
        else:
            checked = arg_list
            names = [b.fields.path for b in checks]
            reason = (f"{g}.check_verbose({arg_list}, "
                      f"tensor_check_names={w.constant(names, 'tensor_names')})")
        also = ""
        for b in self.implied:  # a miss names the setting first when it is what differs
            reason = (f"{w.constant(b.fields.description, 'ambient')}"
                      f".before_tensor_reason({reason})")
            also = f"; they also tell {b.fields.description.ambient.label} apart"
        return [f"if not {g}.check({checked}):",
                f"  return {reason}  # {len(checks)} tensors checked in one C++ call{also}"
                ] + _tensor_comments(checks)


@dataclass(frozen=True)
class ReturnInputs:
    """The fast prologue's last line, ``return (inputs,), pro_to_epi``: ``inputs``, each a name
    or ``STATICS`` (written ``x, *_s[1]``), and what the prologue hands the epilogue."""

    inputs: tuple
    pro_to_epi: tuple

    def __call__(self, w) -> list[str]:
        inputs = inputs_code(self.inputs)
        return [f"return ({inputs + ',' if inputs else ''}), {w.value(self.pro_to_epi)}"]


def _implied_by_tensor_checks(b: BoundSymbol) -> bool:
    """An ambient check that the C++ tensor checks make redundant (inference mode)."""
    ambient = getattr(getattr(b.fields, "description", None), "ambient", None)
    return b.symbol is CHECK and ambient is not None and ambient.implied_by_tensor_checks


# The batched tensor check names what it checks in comments, in the words of the unbatched
# prologue, so that the prologue that runs stays readable; comments cost nothing per call.
def _tensor_comments(checks: list[BoundSymbol]) -> list[str]:
    rows = [(f"{b.args[0].name} from {b.fields.path}:", b.fields.expected) for b in checks]
    width = max(len(who) for who, _ in rows)
    shape_width = max(len(str(tuple(e.shape))) for _, e in rows) + 1
    stride_width = max(len(str(tuple(e.stride))) for _, e in rows) + 1
    return ["# it checks, per tensor:"] + [
        f"#   {who:<{width}} shape {str(tuple(e.shape)) + ',':<{shape_width}} "
        f"stride {str(tuple(e.stride)) + ',':<{stride_width}} dtype {e.dtype}, "
        f"device {e.device}, requires_grad {e.requires_grad}" for who, e in rows]


def _run_at(names: list[str], static_names: list[str]) -> int | None:
    """Where the static tensors appear in ``names`` as one run, in order; ``None`` if they don't."""
    n = len(static_names)
    for i in range(len(names) - n + 1):
        if names[i:i + n] == static_names:
            return i
    return None


def _splice(names: list[str], static_names: list[str], statics: Spliced | None) -> tuple:
    """``names``, with ``statics`` in place of the static tensors where they appear in ``names``
    as one run, in order (``a, *_s[1], b``)."""
    at = _run_at(names, static_names) if statics is not None and static_names else None
    if at is None:
        return tuple(names)
    return (*names[:at], statics, *names[at + len(static_names):])


def _needs_locals(static_names, rest, checks, ret) -> bool:
    """Whether the static tensors must be bound as locals: something reads them by name, or a
    list that holds them (the checked tensors, the returned inputs) cannot splice them in."""
    used = _names_used(rest) | set(_names_in(ret.args[1]))
    if any(n in used for n in static_names):
        return True
    check_names = [b.args[0].name for b in checks]
    input_names = [p.name for p in ret.args[0]]
    return any(any(n in names for n in static_names) and _run_at(names, static_names) is None
               for names in (check_names, input_names))


def _names_used(bsyms: list[BoundSymbol]) -> set[str]:
    used = set()
    for b in bsyms:
        used.update(p.name for p in b.input_proxies())
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
        if b.symbol is UNPACK and b.fields.path.is_attr:
            (parent,) = b.args
            if parent.name in structural_vars:
                parents.add(parent.name)
    return parents


def _module_attributes(part: list[BoundSymbol], dict_vars: list[str], keep: set[str]):
    """Module-attribute reads from cached ``__dict__``s, and their identity checks.

    Returns the lines left, the checks as ``(dict index, key, expected object, description,
    check index)`` and the constant ``__dict__``s of objects whose identity is checked (a config
    object, say), read like module dicts."""
    source_of = {n: i for i, n in enumerate(dict_vars)}  # var -> index of its __dict__
    object_dicts: list[dict] = []
    var_of_path = {}
    read_from: dict[str, tuple[int, str]] = {}  # attribute var -> (dict index, key)
    entries = []  # (dict index, key, expected object, description, check index)
    lines: list[BoundSymbol] = []
    for b in part:
        parent = b.args[0].name if b.symbol is UNPACK else None
        if parent in source_of and b.fields.path.is_attr \
                and (source_of[parent] < len(dict_vars) or b.fields.path.key in
                     object_dicts[source_of[parent] - len(dict_vars)]):
            out, key, index = b.outputs.name, b.fields.path.key, source_of[parent]
            var_of_path[b.fields.path] = out
            read_from[out] = (index, key)
            lines.append(_glue("unpack", lambda w, out=out, index=index, key=key:
                               [f"{out} = _attribute_dicts[{index}][{key!r}]"], binds=b.outputs))
            continue
        g = getattr(b.fields, "guard", None)
        var = var_of_path.get(_subject(b))
        if b.symbol is CHECK and g is not None and var in read_from \
                and g.passes_for_same_object():
            index, key = read_from[var]
            entries.append((index, key, g.expected, b.fields.description, b.fields.index))
            if g.kind.only_that_object and isinstance(getattr(g.expected, "__dict__", None),
                                                      dict):
                source_of[var] = len(dict_vars) + len(object_dicts)
                object_dicts.append(g.expected.__dict__)
            continue
        lines.append(b)
    return lines, entries, object_dicts


def _attribute_lines(lines, entries, keep):
    """The identity checks of the attributes read from the cached dicts, first (an object's own
    dict is read only after its identity check), then the lines left that something reads."""
    checks = [_glue("check", AttributeCheck(*entry)) for entry in entries]

    def defines(b):  # the one name a cached attribute read binds
        return b.outputs.name if b.symbol is glue.PYTHON and b.outputs is not None else None
    used = _names_used([b for b in lines if defines(b) is None]) | keep
    return checks + [b for b in lines if defines(b) is None or defines(b) in used]


@dataclass(frozen=True, eq=False)
class AttributeCheck:
    """``if _attribute_dicts[index][key] is not expected: return check_index``: a module
    attribute checked by identity in its cached ``__dict__`` (the native hit path reads the
    same)."""

    index: int
    key: str
    expected: Any
    description: str
    check_index: int

    def __call__(self, w) -> list[str]:
        return [f"if _attribute_dicts[{self.index}][{self.key!r}] is not "
                f"{_identity(w, self.expected)}: return {self.check_index}  # {self.description}"]


def _identity(w, expected) -> str:
    """``expected`` as the check names it: ``True``, ``False`` and ``None`` as themselves, since
    only they are one object by language rule; anything else by a constant's name."""
    if expected is None or type(expected) is bool:
        return repr(expected)
    return w.constant(expected, "expected")


def _tuple(names: list[str]) -> str:
    if not names:
        return "()"
    return "(" + ", ".join(names) + ("," if len(names) == 1 else "") + ")"


def _targets(names: list[str]) -> str:
    return ", ".join(names) + ("," if len(names) == 1 else "")
