"""dynamo's C++ guards, as the fast prologue uses them: every tensor's metadata checked in one call
(``TensorGuards``).

Module attributes are not checked by dynamo's guard tree (a ``RootGuardManager`` over the
modules' ``__dict__``s): counted by callgrind, its call costs about 2k instructions before its
first guard and then about as much per attribute as a Python line ``if d['training'] is not
True: return 7`` does (about 300), so the Python lines are cheaper at every count."""
from __future__ import annotations

from torch._C._dynamo.guards import TensorGuards


def tensor_guards(checks):
    """One ``TensorGuards`` over the tensors of these ``check_tensor`` lines. The compiling call's
    tensors are held weakly by the trace (an entry must not keep them alive)."""
    reals = [b.fields.real() for b in checks]
    return TensorGuards(*reals, dynamic_dims_sizes=[list(t.shape) for t in reals],
                        dynamic_dims_strides=[list(t.stride()) for t in reals])
