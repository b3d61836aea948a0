"""Replacing attributes of torch's objects, and giving the originals back.

Every patch keraunos applies to torch goes through here: the replacement functions are written
where their logic belongs (Inductor's in ``executors/fusion``, capture's in ``capture``, the
module-hook watch in ``structure``) and handed in; this module sets them on torch's objects and
puts torch's own back.

- ``replaced(find)``: within it, each ``(owner, name, make)`` that ``find()`` lists has
  ``owner.name`` replaced by ``make(original)``. It nests and counts, across threads: the first
  one in replaces, the last one out gives back what was there (unless something else replaced it
  since). ``replace_for_good(find)`` replaces until the process exits.
- ``swap_in(swaps)``/``swap_out(swaps)``: each ``(owner, name, stand_in, original)`` set to its
  stand-in, and back to its original (capture's swaps, entered and left by one thread).
- ``wrap_for_good(owner, names, wrap)``: each ``owner.name`` replaced by ``wrap(it)`` for good.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterable

Replacement = tuple[object, str, Callable]  # (owner, attribute name, make(original))

_lock = threading.RLock()
_applied: dict[tuple[int, str], list] = {}  # (id(owner), name) -> [count, owner, original]


def _take(owner, name: str, make) -> None:
    key = (id(owner), name)
    held = _applied.get(key)
    if held is not None:
        held[0] += 1
        return
    original = owner.__dict__.get(name, getattr(owner, name, None))
    if getattr(original, "_keraunos_patch", False):  # in place for good (a helper process)
        _applied[key] = [1, owner, None]
        return
    replacement = make(original)
    replacement._keraunos_patch = True
    replacement.__wrapped__ = original
    setattr(owner, name, replacement)
    _applied[key] = [1, owner, original]


def _give_back(owner, name: str) -> None:
    key = (id(owner), name)
    held = _applied.get(key)
    if held is None:
        return
    held[0] -= 1
    if held[0] > 0:
        return
    del _applied[key]
    _, owner, original = held
    if original is None:
        return
    current = owner.__dict__.get(name, getattr(owner, name, None))
    if getattr(current, "__wrapped__", None) is original:  # not replaced by someone since
        setattr(owner, name, original)


@contextlib.contextmanager
def replaced(find: Callable[[], list[Replacement]]):
    """Within it, the replacements ``find()`` lists are in place (``find`` runs under the lock)."""
    with _lock:
        taken = find()
        for owner, name, make in taken:
            _take(owner, name, make)
    try:
        yield
    finally:
        with _lock:
            for owner, name, _ in taken:
                _give_back(owner, name)


def replace_for_good(find: Callable[[], list[Replacement]]) -> None:
    """The replacements ``find()`` lists, in place until the process exits."""
    with _lock:
        for owner, name, make in find():
            _take(owner, name, make)


def in_place() -> list[str]:
    """What ``replaced``/``replace_for_good`` hold replaced now, as ``Owner.name``."""
    with _lock:
        return sorted(f"{type(v[1]).__name__ if not isinstance(v[1], type) else v[1].__name__}."
                      f"{k[1]}" for k, v in _applied.items())


def swap_in(swaps: Iterable[tuple[object, str, object, object]]) -> None:
    """Set each ``owner.name`` to its stand-in."""
    for owner, name, stand_in, _ in swaps:
        setattr(owner, name, stand_in)


def swap_out(swaps: Iterable[tuple[object, str, object, object]]) -> None:
    """Set each ``owner.name`` back to its original."""
    for owner, name, _, original in swaps:
        setattr(owner, name, original)


def wrap_for_good(owner, names: Iterable[str], wrap: Callable) -> None:
    """Replace each ``owner.name`` by ``wrap(owner.name)`` until the process exits."""
    for name in names:
        setattr(owner, name, wrap(getattr(owner, name)))


__all__ = ["Replacement", "in_place", "replace_for_good", "replaced", "swap_in", "swap_out",
           "wrap_for_good"]
