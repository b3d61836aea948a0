"""What a user's thread can see of the process: warnings filters, grad and inference mode,
autocast, the default dtype, determinism, anomaly detection, the modes on the dispatch stacks,
``torch.distributions``' default argument validation,
torch.fx's "tracing" flag, the dictionaries of the classes a trace patches (``nn.Module``'s
``__call__`` and ``__getattr__``, ...), and the configs of Dynamo, AOTAutograd and Inductor (when
imported).

``snapshot()`` records them and ``differences(before, after)`` names what changed, one line per
setting. A compile running in the background must leave all of these alone as seen from the
user's thread; the fuzzer's back-to-back mode and ``tests/test_isolation.py`` compare snapshots
taken on the user's thread while such compiles run.

    >>> before = snapshot()
    >>> differences(before, snapshot())
    []
"""
from __future__ import annotations

import sys
import warnings

import torch

from ...torch_internals import dispatch, dynamo, fx

# Config modules compared, when the process has imported them (importing one here would change
# what is compared: Inductor's config is imported by the first fused compile).
CONFIG_MODULES = dynamo.CONFIG_MODULES


def _autocast_state() -> tuple:
    state = []
    for device in ("cpu", "cuda"):
        try:
            state.append((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)))
        except (RuntimeError, TypeError, AttributeError):  # a device type this build lacks
            continue
    return (*state, torch.is_autocast_cache_enabled())


def _config_values(module) -> dict:
    try:
        return module.get_config_copy()
    except Exception:  # noqa: BLE001 - a config that cannot be copied is compared as one value
        return {"<save_config>": module.save_config()}


def _classes() -> list[type]:
    """Classes whose dictionaries a trace or a compile could patch while it runs."""
    return [torch.nn.Module, torch.nn.Linear, torch.nn.LayerNorm, torch.nn.Sequential,
            torch.Tensor, torch.autograd.Function, torch.fx.Tracer, torch.fx.GraphModule]


def _class_dicts() -> dict:
    """``Class.name`` -> the object in the class's ``__dict__`` (compared by identity). The
    hook-registration methods keraunos wraps on the user's thread, at the first walk of a jitted
    module's tree, for good (``keraunos/runtime/structure.py``), and Dynamo's one-time setup
    (``torch_internals.dynamo.unwrapped_setup``) count as torch's own."""
    return {f"{cls.__qualname__}.{key}": _unwatched(value)
            for cls in _classes() for key, value in list(vars(cls).items())
            if callable(value) or hasattr(value, "__get__")}


def _unwatched(value):
    while getattr(value, "_keraunos_hook_watch", False):
        value = value.__wrapped__
    # Dynamo's one-time setup at the first torch.compile in the process, which the fallback
    # route (torch.compile(backend="keraunos"), on the user's thread) makes as any first
    # torch.compile call does: torch's own.
    return dynamo.unwrapped_setup(value)


def _modes() -> tuple:
    """The types of the torch-function and dispatch modes active on this thread."""
    return (tuple(type(m).__name__ for m in dispatch.function_modes()),
            tuple(type(m).__name__ for m in dispatch.dispatch_modes()))


def snapshot() -> dict:
    """The process-wide and thread-local state seen from the calling thread, by setting."""
    state = {
        "warnings.filters": list(warnings.filters),
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "autocast": _autocast_state(),
        "default dtype": torch.get_default_dtype(),
        "deterministic algorithms": (torch.are_deterministic_algorithms_enabled(),
                                     torch.is_deterministic_algorithms_warn_only_enabled()),
        "float32 matmul precision": torch.get_float32_matmul_precision(),
        "anomaly detection": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        "dispatch modes": _modes(),
        "torch.fx tracing flag": fx.tracing(),
        "distributions' argument validation": torch.distributions.Distribution._validate_args,
        "class dicts": _class_dicts(),
    }
    for name in CONFIG_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            state[name] = _config_values(module)
    return state


def _same(a, b) -> bool:
    if callable(a) or callable(b):
        return a is b
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare: their text
        return repr(a) == repr(b)


def differences(before: dict, after: dict) -> list[str]:
    """One line per setting that differs between two snapshots (a config module imported in
    between is not a difference; a changed config names its keys)."""
    found = []
    for key, old in before.items():
        if key not in after:
            continue
        new = after[key]
        if key == "warnings.filters":
            if old != new:
                found.append(f"warnings.filters: {_filters_change(old, new)}")
        elif isinstance(old, dict):
            keys = sorted(k for k in set(old) | set(new)
                          if k not in old or k not in new or not _same(old[k], new[k]))
            if keys:
                shown = ", ".join(f"{k}: {old.get(k, '<missing>')!r} -> {new.get(k, '<missing>')!r}"
                                  for k in keys[:4])
                found.append(f"{key}: {len(keys)} changed ({shown}{', ...' if len(keys) > 4 else ''})")
        elif not _same(old, new):
            found.append(f"{key}: {old!r} -> {new!r}")
    return found


def _filter_text(f) -> str:
    action, message, category, module, lineno = f
    parts = [action, getattr(category, "__name__", str(category))]
    if message is not None:
        parts.append(f"message={getattr(message, 'pattern', message)!r}")
    if module is not None:
        parts.append(f"module={getattr(module, 'pattern', module)!r}")
    return ":".join(parts)


def _filters_change(old: list, new: list) -> str:
    added = [f for f in new if f not in old]
    removed = [f for f in old if f not in new]
    text = f"{len(old)} filters -> {len(new)}"
    if added:
        text += "; added " + ", ".join(_filter_text(f) for f in added[:3])
    if removed:
        text += "; removed " + ", ".join(_filter_text(f) for f in removed[:3])
    if not added and not removed:
        text += "; reordered, first now " + _filter_text(new[0]) if new else ""
    return text


def restore(before: dict, flags: bool = False) -> None:
    """Put back what ``snapshot`` recorded and can be set (warnings filters, grad mode, the
    default dtype, the configs), so that one program's leak does not fail every later one.
    ``flags``: also anomaly detection and torch.fx's tracing flag (only where no trace or
    compile runs on another thread: it would see them change under it)."""
    warnings.filters[:] = before["warnings.filters"]
    warnings._filters_mutated()
    torch.set_grad_enabled(before["grad mode"])
    torch.set_default_dtype(before["default dtype"])
    if flags:
        torch.set_anomaly_enabled(*before["anomaly detection"])
        fx.set_tracing(before["torch.fx tracing flag"])
    for name in CONFIG_MODULES:
        module = sys.modules.get(name)
        values = before.get(name)
        if module is None or values is None or "<save_config>" in values:
            continue
        with warnings.catch_warnings():  # reading a deprecated key warns
            warnings.simplefilter("ignore")
            now = _config_values(module)
            for key, value in values.items():
                if key in now and not _same(now[key], value):
                    try:
                        setattr(module, key, value)
                    except Exception:  # noqa: BLE001 - a key that cannot be set back stays
                        continue
