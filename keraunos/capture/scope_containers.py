"""Lists, dicts and sets in the program's globals and closures: changed during capture, undone.

Capture runs the program's Python for real. ``made.append(t)`` on a global list would append a
fake tensor to it, once, and a cached program would never append again: a silent difference
from eager on every later call. So each such container the program (or a helper it calls) can
reach by name is remembered as it was before the program ran; after capture, one that changed
is put back as it was, and capture is refused with ``ScopeMutationError``, which
``keraunos.jit`` answers with its fallback (``torch.compile(backend="keraunos")`` replays such
changes). A change inside a nested container (``table["k"].append(x)``) is not seen.
"""
from __future__ import annotations

import collections

from ..errors import LazyStateError, ScopeMutationError


def _state(value):
    """What the container holds, by identity of its items (tensors must not be compared by
    ``==``)."""
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, (set, frozenset)):
        return set(value)
    if isinstance(value, bytearray):
        return bytes(value)
    return list(value)


def _same(before, now) -> bool:
    if isinstance(before, (set, bytes)):
        return before == now
    if len(before) != len(now):
        return False
    if before and isinstance(before[0], tuple) and isinstance(now[0], tuple):  # dict items
        return all((k1 is k2 or type(k1) is type(k2) and not hasattr(k1, "__torch_function__")
                    and k1 == k2) and v1 is v2 for (k1, v1), (k2, v2) in zip(before, now))
    return all(a is b for a, b in zip(before, now))


def _restore(value, state) -> None:
    if isinstance(value, dict):
        value.clear()
        value.update(state)
    elif isinstance(value, set):
        value.clear()
        value.update(state)
    elif isinstance(value, collections.deque):
        value.clear()
        value.extend(state)
    else:  # list, bytearray
        value[:] = state


_WATCHED = (list, dict, set, bytearray, collections.deque)


class ScopeContainers:
    """The containers watched during one capture, by id: (what names it, it, its state)."""

    def __init__(self):
        self.watched: dict[int, tuple[str, object, object]] = {}
        self.only_added = False

    def watch(self, where: str, value) -> None:
        if isinstance(value, _WATCHED) and id(value) not in self.watched:
            self.watched[id(value)] = (where, value, _state(value))

    def undo_changes(self) -> list[str]:
        """Put every changed container back as it was; what changed, in words. ``only_added``
        says afterwards whether every change added entries to a mapping and changed nothing
        else: state made on this call (``refuse``)."""
        changed = []
        self.only_added = True
        for where, value, state in self.watched.values():
            now = _state(value)
            if not _same(state, now):
                self.only_added &= isinstance(value, dict) and len(now) > len(state) and \
                    _same(state, now[:len(state)])
                _restore(value, state)
                changed.append(f"{where} ({type(value).__name__})")
        return changed

    def refuse(self, changed: list[str],
               attributes_only_added: bool = False) -> ScopeMutationError | LazyStateError:
        """The error for ``changed``: ``LazyStateError`` when the program only added entries to
        mappings and (``attributes_only_added``) new plain attributes to objects found by name."""
        if self.only_added and attributes_only_added:
            return LazyStateError(
                f"keraunos cannot capture this call as one trace: it adds new entries or "
                f"attributes to {', '.join(changed)}: state that a cached program would make again on every "
                f"call (the change is undone).\n  keraunos.jit runs this call eagerly, which "
                f"makes the state, and captures the next call, which reads it.")
        return ScopeMutationError(
            f"keraunos cannot capture this program as one trace: it changes "
            f"{', '.join(changed)}, which a cached program would not do again on later calls "
            f"(the change is undone).\n  What to do: keraunos.jit(..., fallback=\"dynamo\") (the "
            f"default) runs it through torch.compile(backend=\"keraunos\"), which replays such "
            f"changes; or keep such state in a module attribute or buffer, or return it and "
            f"update it outside the jitted function.")

