"""Per-thread capture state, and the global state (grad mode, autocast) a program may switch."""
from __future__ import annotations

import threading

import torch

from ..core.symbols import GlueSymbol

_active = threading.local()


def active_context():
    """The capture running in this thread (a ``CaptureContext``), or None."""
    return getattr(_active, "ctx", None)


def requested_dynamic():
    """What the next capture in this thread makes symbolic (a ``DynamicRequest``, set by ``jit``
    around its compilation), or None: exact sizes."""
    return getattr(_active, "dynamic", None)




_AUTOCAST_DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def global_state() -> tuple:
    """Grad mode, then (enabled, dtype) of autocast for each device type."""
    state = [torch.is_grad_enabled()]
    for device in _AUTOCAST_DEVICES:
        state += [torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)]
    return tuple(state)


def restore_global_state(state: tuple) -> None:
    torch._C._set_grad_enabled(state[0])
    for i, device in enumerate(_AUTOCAST_DEVICES):
        torch.set_autocast_enabled(device, state[1 + 2 * i])
        torch.set_autocast_dtype(device, state[2 + 2 * i])


def _set_global_state_formatter(bsym, w):
    lines = []
    for i, value in bsym.args[0]:
        if i == 0:
            lines.append(f"torch._C._set_grad_enabled({value!r})")
        else:
            device = _AUTOCAST_DEVICES[(i - 1) // 2]
            if (i - 1) % 2 == 0:
                lines.append(f"torch.set_autocast_enabled({device!r}, {value!r})")
            else:
                lines.append(f"torch.set_autocast_dtype({device!r}, {w.value(value)})")
    return lines


SET_GLOBAL_STATE = GlueSymbol("set_global_state", _set_global_state_formatter)
