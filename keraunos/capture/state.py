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
    set_grad_enabled(state[0])
    for i, device in enumerate(_AUTOCAST_DEVICES):
        torch.set_autocast_enabled(device, state[1 + 2 * i])
        torch.set_autocast_dtype(device, state[2 + 2 * i])


