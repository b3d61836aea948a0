"""dynamo's C++ guard trees, as the fast prologue uses them: every tensor's metadata checked in
one call (``TensorGuards``), and module attributes checked by identity in one call (a
``RootGuardManager`` over the modules' ``__dict__``s). The expected values are held here so that
their ids stay theirs."""
from __future__ import annotations

from typing import Any

from torch._C._dynamo.guards import TensorGuards


def tensor_guards(checks):
    """One ``TensorGuards`` over the tensors of these ``check_tensor`` lines. The compiling call's
    tensors are held weakly by the trace (an entry must not keep them alive)."""
    reals = [b.fields.real() for b in checks]
    return TensorGuards(*reals, dynamic_dims_sizes=[list(t.shape) for t in reals],
                        dynamic_dims_strides=[list(t.stride()) for t in reals])


def attribute_guards(entries, example_dicts):
    """A guard tree checking each ``(dict index, key, expected, description, _)`` entry by
    identity; ``None`` when this torch has no guard-tree API."""
    try:
        from torch._C._dynamo.guards import RootGuardManager
        from torch._dynamo.guards import GuardManagerType
        kind = GuardManagerType.GUARD_MANAGER
        root = RootGuardManager()
        per_dict: dict[int, Any] = {}
        for index, key, expected, description, _ in entries:
            manager = per_dict.get(index)
            if manager is None:
                manager = per_dict[index] = root.tuple_getitem_manager(
                    index, f"dicts[{index}]", example_dicts[index], kind)
            item = manager.dict_getitem_manager(key, f"dicts[{index}][{key!r}]", expected, kind)
            item.add_id_match_guard(id(expected), [description], None)
        return AttributeGuards(root, [e[2] for e in entries], len(entries))
    except Exception:  # an older or newer torch without this guard API: Python checks instead
        return None


class AttributeGuards:
    """dynamo's C++ guard tree over module ``__dict__`` entries; holds the expected objects so
    their ids stay theirs."""

    def __init__(self, root, expected, count):
        self.root = root
        self.expected = expected
        self.count = count
        self.check = root.check

    def reason(self, dicts) -> str:
        parts = self.root.check_verbose(dicts).verbose_code_parts
        return (parts[0] if parts else "a module attribute changed") + \
            " (module attributes are checked by identity: an equal new value also recompiles once)"
