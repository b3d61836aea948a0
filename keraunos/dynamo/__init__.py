"""The second front end: ``torch.compile(model, backend="keraunos")``.

Dynamo does the bytecode analysis, the guards and the graph breaks; each FX graph it hands over
is compiled by keraunos's own pipeline (capture on fake tensors, passes, the autograd split into
forward and backward traces, executors), so every subgraph has readable traces.

    >>> import torch, keraunos.dynamo
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    >>> compiled = torch.compile(model, backend="keraunos")
    >>> out = compiled(torch.randn(2, 8))
    >>> print(keraunos.dynamo.last_traces(compiled)[0].forward)  # doctest: +SKIP

What the route checks per call: dynamo's guards decide which subgraph runs; keraunos adds no
second prologue of checks for a graph with static shapes (its entry is compiled with
``cache="same input"``), and once it is compiled dynamo calls its computation function
itself, without keraunos's call path around it (``backend.lean_call``; a graph that writes an
input keeps the check of memory shared between inputs). A graph dynamo made dynamic (its
automatic dynamic shapes, or ``dynamic=True``) takes sizes that vary under one set of guards:
keraunos compiles it per set of sizes and keeps the cheap metadata check (``cache="constant
values"``) and its whole call path, so a stale entry is never reused.

A subgraph's backward (training) reads past the lines that hand on their input's data unchanged,
the ``t(t(w))`` pairs of the mm derivative formulas among them (``keraunos.passes.peephole``, a
stage of every compilation; its trace is labelled ``Peephole (no-op chains)`` in
``last_traces(compiled)[i].backward``).
"""
from __future__ import annotations

from .backend import (Backend, GraphBreak, SubgraphTraces, backend, backend_entry,
                      graph_breaks, last_traces)

__all__ = ["Backend", "GraphBreak", "SubgraphTraces", "backend", "backend_entry",
           "graph_breaks", "last_traces"]
