"""Ambient state: what a call's result depends on besides its inputs, checked by every prologue.

Grad mode, inference mode, the default dtype, autocast (per device type: on or off, its dtype,
and whether it caches casts), deterministic algorithms, matmul precision, intra-op threads: a
program captured under one setting may compute something else under another (autocast to
bfloat16 or float16 rounds differently), so the prologue compares each with what it was at
capture, and a difference is a cache miss that names the setting.

``AMBIENT_STATE`` is the one list. A new kind of ambient state is one more ``Ambient`` in it:
the prologue checks it, the miss explanation names it. Entries that dynamo's C++
``GlobalStateGuard`` also compares are checked by one call of it (a fifth of a microsecond for
all of them); the rest are one Python comparison each, calling the C function that reads the
setting by a name of the prologue's own (``_get_autocast_dtype('cpu')``): ``torch.x`` costs a
module attribute lookup per call, and ``torch.get_float32_matmul_precision`` is a Python wrapper
around the C extension's ``_get_float32_matmul_precision``.

Inference mode needs no check of its own where the prologue checks a tensor's metadata in C++
(``implied_by_tensor_checks``): dynamo's tensor guards compare each tensor's dispatch keys as the
thread's dispatch state modifies them, and entering or leaving inference mode changes that state
(autograd keys excluded, ``ADInplaceOrView`` no longer included), so a tensor checked under one
setting fails under the other, whatever grad mode says (``torch.enable_grad()`` inside
``torch.inference_mode()`` leaves the keys as inference mode set them). Dynamo relies on the same.
"""
from __future__ import annotations

import enum

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

import torch

from ..torch_internals import dispatch
from ..torch_internals.dynamo import GlobalStateGuard  # None in a build without dynamo's guards


@dataclass(frozen=True)
class Ambient:
    """One piece of ambient state: ``label`` names it in a miss explanation, ``expression`` is
    the prologue's source that reads it (``torch`` is in every prologue's namespace), ``read``
    reads it now; ``in_global_state_guard``: ``GlobalStateGuard`` compares it too; ``names``: the
    prologue globals its expression calls besides ``torch``; ``implied_by_tensor_checks``: a
    failing C++ tensor check already tells it apart (the module docstring says why)."""

    label: str
    expression: str
    read: Callable[[], Any]
    in_global_state_guard: bool
    names: Mapping[str, Any] = field(default_factory=dict)
    implied_by_tensor_checks: bool = False
    # Where ``expression`` raises in some states (``read`` then gives a tuple instead), the
    # expression an entry compiled in such a state checks (its names are in ``names`` too).
    expression_when_tuple: str | None = None
    # How the native hit path reads it itself, if it does (``runtime/native``); for autocast's
    # dtype, on which device type.
    native: NativeRead | None = None
    device: str | None = None


class NativeRead(enum.Enum):
    """The settings the native hit path reads with C++ getters of its own (``hit_path.cpp``)."""

    AUTOCAST_DTYPE = "at::autocast::get_autocast_dtype"
    FLOAT32_MATMUL_PRECISION = "at::globalContext().float32MatmulPrecision()"
    INFERENCE_MODE = "c10::InferenceMode::is_enabled()"


def _autocast_device_types() -> tuple[str, ...]:
    """The CPU and the accelerators this process can use: autocast on any other device type
    disables itself (with a warning), so its settings cannot change what a program computes."""
    found = ["cpu"]
    for device in ("cuda", "xpu", "mps"):
        module = getattr(torch, device, None)
        if module is not None and getattr(module, "is_available", lambda: False)():
            found.append(device)
    return tuple(found)


def _autocast_entries(device: str) -> tuple[Ambient, ...]:
    return (
        Ambient(f"autocast on {device}", f"torch.is_autocast_enabled({device!r})",
                lambda: torch.is_autocast_enabled(device), True),
        # Compared even while autocast is off (`with torch.autocast(device):` inside the
        # program takes this dtype), which GlobalStateGuard does not do: so in Python.
        Ambient(f"autocast dtype on {device}", f"_get_autocast_dtype({device!r})",
                lambda: torch.get_autocast_dtype(device), False,
                {"_get_autocast_dtype": torch.get_autocast_dtype},
                native=NativeRead.AUTOCAST_DTYPE, device=device),
    )


# What torch's getter summarizes, read one by one where it cannot (below).
_FP32_PRECISIONS = (("generic", "all"), ("cuda", "matmul"), ("mkldnn", "matmul"))


def _float32_matmul_precision() -> str | tuple[str, ...]:
    """``torch.get_float32_matmul_precision()``; once a program set precisions per backend
    (``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``), torch's getter raises (it has no
    one name for them) and the precisions are read one by one instead."""
    try:
        return dispatch.float32_matmul_precision()
    except RuntimeError:
        return tuple(dispatch.fp32_precision(backend, op)
                     for backend, op in _FP32_PRECISIONS)


AMBIENT_STATE: tuple[Ambient, ...] = (
    Ambient("grad mode", "torch.is_grad_enabled()", torch.is_grad_enabled, True),
    # Under no_grad and inference_mode grad mode reads the same; their outputs do not
    # (inference tensors), so inference mode is a setting of its own.
    Ambient("inference mode", "_is_inference_mode_enabled()", torch.is_inference_mode_enabled,
            False, {"_is_inference_mode_enabled": torch.is_inference_mode_enabled},
            implied_by_tensor_checks=True, native=NativeRead.INFERENCE_MODE),
    Ambient("default dtype", "torch.get_default_dtype()", torch.get_default_dtype, True),
    *(entry for device in _autocast_device_types() for entry in _autocast_entries(device)),
    Ambient("autocast's cast cache", "torch.is_autocast_cache_enabled()",
            torch.is_autocast_cache_enabled, True),
    Ambient("deterministic algorithms", "torch.are_deterministic_algorithms_enabled()",
            torch.are_deterministic_algorithms_enabled, True),
    Ambient("deterministic algorithms, warn only",
            "torch.is_deterministic_algorithms_warn_only_enabled()",
            torch.is_deterministic_algorithms_warn_only_enabled, True),
    Ambient("float32 matmul precision", "_get_float32_matmul_precision()",
            _float32_matmul_precision, False,
            {"_get_float32_matmul_precision": dispatch.float32_matmul_precision,
             "_float32_matmul_precision": _float32_matmul_precision},
            expression_when_tuple="_float32_matmul_precision()",
            native=NativeRead.FLOAT32_MATMUL_PRECISION),
    Ambient("TF32 matmuls (cuBLAS)", "torch.backends.cuda.matmul.allow_tf32",
            lambda: torch.backends.cuda.matmul.allow_tf32, True),
    Ambient("float16 reduced-precision reductions (cuBLAS)",
            "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
            lambda: torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction, True),
    Ambient("bfloat16 reduced-precision reductions (cuBLAS)",
            "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
            lambda: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction, True),
    # Only where CUDA runs: reading it costs a third of a microsecond.
    *((Ambient("TF32 convolutions (cuDNN)", "torch.backends.cudnn.allow_tf32",
               lambda: torch.backends.cudnn.allow_tf32, False),)
      if torch.cuda.is_available() else ()),
    # Fused CPU kernels bake the thread count in; GlobalStateGuard compares it anyway.
    Ambient("intra-op threads", "torch.get_num_threads()", torch.get_num_threads, True),
)


def _expression_for(ambient: Ambient, value: Any) -> Ambient:
    """``ambient``, checked by the expression that does not raise in the state ``value`` was
    read in. In the other state that one raises: the prologue then means "not this entry"."""
    if type(value) is tuple and ambient.expression_when_tuple is not None:
        return replace(ambient, expression=ambient.expression_when_tuple)
    return ambient


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return repr(value)


@dataclass
class AmbientSnapshot:
    """The ambient state at capture: the values of ``AMBIENT_STATE``, and dynamo's C++ guard
    over the entries it covers (``None`` where this build has none)."""

    values: tuple
    cxx_guard: Any

    @classmethod
    def now(cls) -> "AmbientSnapshot":
        return cls(tuple(a.read() for a in AMBIENT_STATE),
                   GlobalStateGuard() if GlobalStateGuard is not None else None)

    def python_checked(self) -> list[tuple[Ambient, Any]]:
        """The entries the prologue compares in Python, with their values at capture."""
        in_cxx = self.cxx_guard is not None
        return [(_expression_for(a, v), v) for a, v in zip(AMBIENT_STATE, self.values)
                if not (in_cxx and a.in_global_state_guard)]

    def cxx_description(self) -> "AmbientDifference":
        """What the C++ check compares, in a line: autocast is named only where it is on."""
        covered = [(a, v) for a, v in zip(AMBIENT_STATE, self.values) if a.in_global_state_guard]
        labels = [f"{a.label} {_show(v)}" for a, v in covered]
        return AmbientDifference(self, "as compiled: " + ", ".join(labels))

    def description(self, ambient: Ambient, value: Any) -> "AmbientDifference":
        return AmbientDifference(self, f"as compiled: {ambient.label} {_show(value)}", ambient)

    def differences(self) -> list[str]:
        return [f"{a.label} is {_show(now)}, compiled with {_show(then)}"
                for a, then in zip(AMBIENT_STATE, self.values)
                if (now := a.read()) != then or type(now) is not type(then)]


class AmbientDifference(str):
    """A check's description: as a string, what the prologue's comment says; ``explain_miss()``
    names what differs now (the C++ check compares many settings at once)."""

    def __new__(cls, snapshot: AmbientSnapshot, text: str, ambient: Ambient | None = None):
        self = super().__new__(cls, text)
        self.snapshot = snapshot
        self.ambient = ambient  # the one setting a Python check compares; None for the C++ one
        return self

    def explain_miss(self) -> str:
        differences = self.snapshot.differences()
        if not differences:  # a setting outside the list (GlobalStateGuard compares more)
            reason = self.snapshot.cxx_guard.reason().strip()
            differences = [f"{reason} differs from when compiled"]
        return "; ".join(differences)

    def compiled_value(self) -> Any:
        """The value at capture of the one setting this check compares (its expression may be
        the one for a tuple: ``_expression_for``; the setting is the same)."""
        return self.snapshot.values[_LABELS.index(self.ambient.label)]

    def before_tensor_reason(self, reason: str) -> str:
        """A failed tensor check's ``reason``, after this setting's difference when there is one
        (for a check the tensor checks stand in for: ``implied_by_tensor_checks``)."""
        a = self.ambient
        now, then = a.read(), self.compiled_value()
        if now == then:
            return reason
        return (f"{a.label} is {_show(now)}, compiled with {_show(then)}; "
                f"the tensor checks: {reason}")

    def __reduce__(self):
        # With its snapshot, so that a stored program's prologue takes the native hit path
        # and explains its misses as the captured one does; the setting by its label, found
        # again in the loading process's list.
        ambient = self.ambient
        return _difference, (self.snapshot, str(self), _LABELS,
                             None if ambient is None else (ambient.label, ambient.expression))


_LABELS = tuple(a.label for a in AMBIENT_STATE)


def _difference(snapshot: AmbientSnapshot, text: str, labels: tuple, ambient) -> str:
    """An ``AmbientDifference`` again (``__reduce__``); the plain text where this process
    lists other settings (another set of autocast device types): its values are not this
    list's, and the check then reads as text, on the Python hit path."""
    if labels != _LABELS or len(snapshot.values) != len(AMBIENT_STATE):
        return text
    if ambient is None:
        return AmbientDifference(snapshot, text)
    label, expression = ambient
    found = AMBIENT_STATE[_LABELS.index(label)]
    if found.expression != expression:
        found = replace(found, expression=expression)
    return AmbientDifference(snapshot, text, found)
