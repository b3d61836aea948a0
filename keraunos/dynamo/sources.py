"""Source lines of a subgraph's traces: the user's file and line, not dynamo's generated code;
and the layer (a repeated module of a ``ModuleList``) each line came from, for fusion."""
from __future__ import annotations

import linecache
import re

import torch

from ..core.symbols import Source
from ..core.trace import Trace
from ..transforms import Transform

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def _user_source_of(node: torch.fx.Node) -> Source | None:
    """The innermost user frame dynamo recorded for the node (its ``stack_trace``)."""
    frames = list(_FRAME.finditer(node.meta.get("stack_trace") or ""))
    if not frames:
        return None
    filename, lineno = frames[-1]["file"], int(frames[-1]["line"])
    return Source(filename, lineno, linecache.getline(filename, lineno).strip())


def _module_path(path: str) -> str:
    """``L['self'].model.layers.0`` -> ``model.layers.0`` (dynamo's name for the module)."""
    return re.sub(r"^L\['[^']*'\]\.?", "", path)


def layers_of_nodes(gm: torch.fx.GraphModule) -> dict[str, str]:
    """FX node name -> the layer it came from, found in dynamo's ``nn_module_stack``: the
    outermost module of the node's stack that is an indexed child (``layers.3``) whose class
    another child of the same parent shares and which has submodules of its own. The same rule
    as ``keraunos.jit``'s capture uses (``fusion.layers.repeated_modules``), which sees the
    modules themselves; here the GraphModule is flat and only the stacks say."""
    stacks = [(n.name, list((n.meta.get("nn_module_stack") or {}).values()))
              for n in gm.graph.nodes]
    paths = {_module_path(str(path)): cls for _, stack in stacks for path, cls in stack}
    children: dict[tuple[str, object], int] = {}
    for path, cls in paths.items():
        parent, _, key = path.rpartition(".")
        if key.isdigit():
            children[(parent, cls)] = children.get((parent, cls), 0) + 1
    layers = set()
    for path, cls in paths.items():
        parent, _, key = path.rpartition(".")
        if (key.isdigit() and children[(parent, cls)] > 1
                and any(p.startswith(path + ".") for p in paths)):
            layers.add(path)
    result = {}
    for name, stack in stacks:
        found = next((p for p in (_module_path(str(path)) for path, _ in stack) if p in layers),
                     None)
        if found is not None:
            result[name] = found
    return result


class UserSourceLines(Transform):
    """Points each line of the computation at the user's line that dynamo traced it from, and
    tags it with its layer (``bsym.layer``, what the fusion executor cuts regions at so that
    identical layers share one kernel; see ``layers_of_nodes``).

    Capture sees the GraphModule's generated code (``<eval_with_key>.N``), whose lines read
    ``name = op(...)``: the name is the FX node, and the node keeps dynamo's stack trace."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.sources = {n.name: s for n in gm.graph.nodes
                        if (s := _user_source_of(n)) is not None}
        self.layers = layers_of_nodes(gm)

    @property
    def name(self) -> str:
        return "User Source Lines"

    @staticmethod
    def _node_name(source: Source | None) -> str | None:
        # Not the code's own file name: a lazily compiled GraphModule gets its code on first call.
        if source is None or not source.filename.startswith("<eval_with_key>"):
            return None
        return source.code.split(" = ", 1)[0].strip()

    def _line(self, bsym):
        node = self._node_name(bsym.source)
        if node is None:
            return bsym
        layer = self.layers.get(node)
        return bsym.replace(source=self.sources.get(node, bsym.source),
                            layer=bsym.layer if layer is None else layer)

    def transform_traces_pre_prologue(self, prologue: Trace, computation: Trace,
                                      epilogue: Trace) -> tuple[Trace, Trace, Trace]:
        lines = [self._line(b) for b in computation.bound_symbols]
        return prologue, Trace(computation.name, list(computation.params), lines,
                               list(computation.header), dict(computation.namespace)), epilogue
