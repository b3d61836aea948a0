"""Source lines of a subgraph's traces: the user's file and line, not dynamo's generated code."""
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


class UserSourceLines(Transform):
    """Points each line of the computation at the user's line that dynamo traced it from.

    Capture sees the GraphModule's generated code (``<eval_with_key>.N``), whose lines read
    ``name = op(...)``: the name is the FX node, and the node keeps dynamo's stack trace."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.sources = {n.name: s for n in gm.graph.nodes
                        if (s := _user_source_of(n)) is not None}

    @property
    def name(self) -> str:
        return "User Source Lines"

    def _source(self, source: Source | None) -> Source | None:
        # Not the code's own file name: a lazily compiled GraphModule gets its code on first call.
        if source is None or not source.filename.startswith("<eval_with_key>"):
            return source
        node_name = source.code.split(" = ", 1)[0].strip()
        return self.sources.get(node_name, source)

    def transform_traces_pre_prologue(self, prologue: Trace, computation: Trace,
                                      epilogue: Trace) -> tuple[Trace, Trace, Trace]:
        lines = [b.replace(source=self._source(b.source)) for b in computation.bound_symbols]
        return prologue, Trace(computation.name, list(computation.params), lines,
                               list(computation.header), dict(computation.namespace)), epilogue
