"""Per-thread capture state, and the global state (grad mode, autocast) a program may switch."""
from __future__ import annotations

import threading

import torch

from ..torch_internals.autograd import set_grad_enabled
from ..core.glue import AUTOCAST_DEVICES as _AUTOCAST_DEVICES

_active = threading.local()


def active_context():
    """The capture running in this thread (a ``CaptureContext``), or None."""
    return getattr(_active, "ctx", None)


def global_state() -> tuple:
    """Grad mode, then (enabled, dtype) of autocast for each device type."""
    state = [torch.is_grad_enabled()]
    for device in _AUTOCAST_DEVICES:
        state += [torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)]
    return tuple(state)


def restore_global_state(state: tuple) -> None:
    switch_global_state(enumerate(state))


def switch_global_state(switches) -> None:
    """Set each ``(index, value)`` of ``switches``: the index of the setting in
    ``global_state()``'s layout (a ``SET_GLOBAL_STATE`` line's arguments)."""
    for i, value in switches:
        if i == 0:
            set_grad_enabled(value)
            continue
        device = _AUTOCAST_DEVICES[(i - 1) // 2]
        if (i - 1) % 2 == 0:
            torch.set_autocast_enabled(device, value)
        else:
            torch.set_autocast_dtype(device, value)


