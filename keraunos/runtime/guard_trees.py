"""dynamo's C++ guards, as the fast prologue uses them: every tensor's metadata checked in one call,
by ``TensorGuards`` (``check(x, w)``) for a few tensors and by dynamo's guard tree
(``TensorTree``: a ``RootGuardManager`` with a tensor-match guard per item of the tuple it gets,
``check((x, w, ...))``) from ``TREE_FROM`` tensors on. Both compare the same metadata (type,
dispatch keys as the thread's dispatch state modifies them, dtype, device, requires_grad, sizes,
strides) with the same C++ code; counted by callgrind, a ``TensorGuards`` call costs about 1.1k
instructions plus 1.05k a tensor, the tree's 2.2k plus 0.8k a tensor.

Module attributes are not checked by dynamo's guard tree (a ``RootGuardManager`` over the
modules' ``__dict__``s): counted by callgrind, its call costs about 2k instructions before its
first guard and then about as much per attribute as a Python line ``if d['training'] is not
True: return 7`` does (about 300), so the Python lines are cheaper at every count."""
from __future__ import annotations

from ..torch_internals import dynamo
from ..torch_internals.dispatch import dispatch_keys
from ..torch_internals.dynamo import TensorGuards


TREE_FROM = 4


def tensor_guards(checks):
    """One C++ check of the tensors of these ``check_tensor`` lines: a ``TensorTree`` from
    ``TREE_FROM`` tensors on (where this torch has the API), else a ``TensorGuards``. The
    compiling call's tensors are held weakly by the trace (an entry must not keep them alive)."""
    reals = [b.fields.real() for b in checks]
    if len(reals) >= TREE_FROM:
        tree = TensorTree.of(reals, [str(b.fields.path) for b in checks])
        if tree is not None:
            return tree
    return TensorGuards(*reals, dynamic_dims_sizes=[list(t.shape) for t in reals],
                        dynamic_dims_strides=[list(t.stride()) for t in reals])


class TensorTree:
    """dynamo's guard tree over a tuple of tensors: ``check(tensors)`` (the root's own C++
    method), ``reason(tensors)`` on a failure."""

    def __init__(self, root):
        self.root = root
        self.check = root.check

    @classmethod
    def of(cls, reals, names) -> "TensorTree | None":
        try:
            kind = dynamo.GuardManagerType.GUARD_MANAGER
            root = dynamo.RootGuardManager()
            for i, (t, name) in enumerate(zip(reals, names)):
                item = root.tuple_getitem_manager(i, name, t, kind)
                item.add_tensor_match_guard(t, list(t.shape), list(t.stride()), name, [name],
                                            None, type(t), dispatch_keys(t))
        except Exception:  # an older or newer torch without this guard API: TensorGuards
            return None
        return cls(root)

    def reason(self, tensors) -> str:
        parts = self.root.check_verbose(tensors).verbose_code_parts
        # Without dynamo's advice about its own config, which a parameter's failure adds.
        return parts[0].split(" Guard failed on a parameter")[0] if parts else \
            "a tensor's metadata changed"
