"""Source lines of a subgraph's traces: the user's file and line, not dynamo's generated code;
and the module calls each line came from (what fusion cuts regions at)."""
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


def module_stacks_of_nodes(gm: torch.fx.GraphModule) -> dict[str, tuple]:
    """FX node name -> the module calls it was traced in, outermost first, from dynamo's
    ``nn_module_stack``: (qualified name, class) pairs, as ``bsym.module_stack`` holds them."""
    result = {}
    for n in gm.graph.nodes:
        stack = tuple((_module_path(str(path)), cls)
                      for path, cls in (n.meta.get("nn_module_stack") or {}).values())
        if stack:
            result[n.name] = stack
    return result


class UserSourceLines(Transform):
    """Points each line of the computation at the user's line that dynamo traced it from, and
    gives it the module calls dynamo traced it in (``bsym.module_stack``, where the fusion
    executor cuts regions so that identical layers share one kernel).

    Capture sees the GraphModule's generated code (``<eval_with_key>.N``), whose lines read
    ``name = op(...)``: the name is the FX node, and the node keeps dynamo's stack trace."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.sources = {n.name: s for n in gm.graph.nodes
                        if (s := _user_source_of(n)) is not None}
        self.module_stacks = module_stacks_of_nodes(gm)

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
        return bsym.replace(source=self.sources.get(node, bsym.source),
                            module_stack=self.module_stacks.get(node, bsym.module_stack))

    def transform_traces_pre_prologue(self, prologue: Trace, computation: Trace,
                                      epilogue: Trace) -> tuple[Trace, Trace, Trace]:
        lines = [self._line(b) for b in computation.bound_symbols]
        return prologue, Trace(computation.name, list(computation.params), lines,
                               list(computation.header), dict(computation.namespace)), epilogue
