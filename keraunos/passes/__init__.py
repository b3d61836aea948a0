"""Passes: functions from trace to trace (see ``core.runner.trace_pass``); ``keraunos/runtime/pipeline.py``
runs them in the order its ``STAGES`` list."""
from .cse import common_subexpression_elimination
from .dce import dead_code_elimination
from .deletion import delete_last_used

__all__ = ["dead_code_elimination", "common_subexpression_elimination", "delete_last_used"]
