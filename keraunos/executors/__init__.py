"""Executors: who runs each line of a trace.

An executor claims the bound symbols it can run; ``claim`` walks a trace and gives each line to
the first executor in the user's list that claims it, then lets that executor ``lower`` the line
(rewrite it to call what really runs it). The ``torch`` executor claims every torch-level
operation and runs it as written; the ``python`` executor the glue of prologues and epilogues
(unpacking, checks, write-backs). An ``OperatorExecutor`` maps torch ops to callables of yours:
the lines it claims call your callable instead. The ``inductor`` fusion executor
(``executors=["inductor", "torch"]``, see ``executors/fusion``) claims the lines it may fuse, and
after the claims each run of them becomes one line calling an Inductor-compiled region; what it
leaves goes to the next executor in the list. A custom kernel plugs in like this:

    >>> import torch, keraunos
    >>> mine = keraunos.executors.OperatorExecutor("my_kernels")
    >>> mine.register_implementation(torch.nn.functional.gelu,
    ...                              lambda x, approximate="none": x * torch.sigmoid(1.702 * x))
    >>> _ = keraunos.executors.register(mine)
    >>> f = keraunos.jit(torch.nn.functional.gelu, executors=["my_kernels", "torch"])
"""
from .base import (DEFAULT_EXECUTORS, Executor, FusionExecutor, OperatorExecutor, PythonExecutor,
                   TorchExecutor, claim, fusion_executors, give_back, register, resolve)
from .fusion import InductorExecutor

__all__ = ["DEFAULT_EXECUTORS", "Executor", "FusionExecutor", "OperatorExecutor", "PythonExecutor",
           "TorchExecutor", "InductorExecutor", "claim", "fusion_executors", "give_back",
           "register", "resolve"]

register(InductorExecutor())
