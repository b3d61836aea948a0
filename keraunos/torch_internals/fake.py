"""Fake tensors, their mode, and symbolic sizes: what capture runs a program on.

Owns ``FakeTensorMode`` and ``FakeTensor`` with the exceptions a fake kernel raises, the shape
environment (``ShapeEnv``) with its symbols, guards and value ranges, the tracing context a
compile runs in, the sympy functions torch's symbolic sizes are made of, and eager's choice of
an output's memory format (``suggest_memory_format``). Plain re-exports:
these are the same in every supported release.
"""
from __future__ import annotations

from torch._guards import ShapeGuard, SLoc, TracingContext, tracing
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                           DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode, UnsupportedOperatorException,
                                           unset_fake_temporarily)
from torch.fx.experimental.symbolic_shapes import (DimDynamic, GuardOnDataDependentSymNode,
                                                    ShapeEnv, StatelessSymbolicContext,
                                                    free_unbacked_symbols)
from torch.utils._sympy.functions import FloorDiv, Max, Min, Mod, PythonMod
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.value_ranges import ValueRanges

# The logger fake tensors report through (capture quiets it while a program is captured).
LOGGER_NAME = "torch._subclasses.fake_tensor"

__all__ = ["DataDependentOutputException", "DimDynamic", "DynamicOutputShapeException",
           "FakeTensor", "FakeTensorMode", "FloorDiv", "GuardOnDataDependentSymNode",
           "LOGGER_NAME", "Max", "Min", "Mod", "PythonMod", "SLoc", "ShapeEnv", "ShapeGuard",
           "StatelessSymbolicContext", "TracingContext", "UnsupportedOperatorException",
           "ValueRanges", "free_unbacked_symbols", "int_oo", "suggest_memory_format", "tracing",
           "unset_fake_temporarily"]
