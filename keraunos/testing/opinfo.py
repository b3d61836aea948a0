"""Run one OpInfo (``torch.testing._internal.common_methods_invocations.op_db``) through keraunos.

For an OpInfo with float32 CPU samples, ``check_op(op, kind)`` runs every sample (or the first
``max_samples``) eagerly and through ``keraunos.jit``, and compares:
- ``forward``: the outputs (same RNG seed for both, so random ops compare too);
- ``backward``: the gradients of every input that requires grad, for ops that support autograd;
- ``inplace``: the mutated input and the result of ``op.inplace_variant``.
It returns a ``Result``: ``passed``, ``failed`` (with the first line of the error) or
``not applicable`` (with why). Needs the ``expecttest`` package (the ``test`` extra).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

import keraunos

KINDS = ("forward", "backward", "inplace")


@dataclass
class Result:
    op: str
    kind: str
    status: str  # "passed", "failed", "not applicable"
    message: str = ""


def op_database():
    from torch.testing._internal.common_methods_invocations import op_db
    return op_db


def op_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _tensors(tree):
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _clone(tree):
    return pytree.tree_map(lambda x: x.detach().clone().requires_grad_(x.requires_grad)
                           if isinstance(x, torch.Tensor) else x, tree)


def _call_jitted(fn, sample_input, args, kwargs, executors=None):
    """``keraunos.jit`` of the op; values keraunos cannot take as arguments are closed over."""
    # fallback="error": the sweep measures capture, not the backend route a refusal falls to.
    # Without executors, the torch executor alone; with fusion, the fused program at once.
    fuse = "wait" if executors else "off"
    jf = keraunos.jit(fn, executors=executors, fallback="error", fuse=fuse)
    try:
        return jf(sample_input, *args, **kwargs)
    except keraunos.UnsupportedInputError:
        jf = keraunos.jit(lambda x: fn(x, *args, **kwargs), executors=executors,
                          fallback="error", fuse=fuse)
        return jf(sample_input)


# Ops whose outputs are uninitialized memory: only their metadata can be compared.
UNINITIALIZED = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
                 "empty_permuted"}


def _compare_metadata(actual, expected, what: str) -> None:
    for a, e in zip(pytree.tree_leaves(actual), pytree.tree_leaves(expected)):
        if isinstance(e, torch.Tensor):
            if (a.shape, a.dtype, a.device) != (e.shape, e.dtype, e.device):
                raise AssertionError(f"{what}: {a.shape} {a.dtype} {a.device} != eager's "
                                     f"{e.shape} {e.dtype} {e.device}")


# float32 tolerances: torch.testing's defaults; with a fusion executor, those of PyTorch's own
# accuracy check of compiled models (dynamo's ``utils.same``, tol=1e-4): Inductor reorders
# reductions and fuses arithmetic, so results differ from eager in the last bits.
EXACT = dict(atol=1e-5, rtol=1.3e-6)
FUSED = dict(atol=1e-4, rtol=1e-4)


def _compare(actual, expected, what: str, tolerance=EXACT) -> None:
    a_leaves, e_leaves = pytree.tree_leaves(actual), pytree.tree_leaves(expected)
    if len(a_leaves) != len(e_leaves):
        raise AssertionError(f"{what}: {len(a_leaves)} values, eager has {len(e_leaves)}")
    for a, e in zip(a_leaves, e_leaves):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(a, e, equal_nan=True, **tolerance,
                                       msg=lambda m: f"{what}: {m}")
        elif a != e and not (a != a and e != e):
            raise AssertionError(f"{what}: {a!r} != eager's {e!r}")


def _samples(op, requires_grad: bool, max_samples: int | None):
    samples = op.sample_inputs("cpu", torch.float32, requires_grad=requires_grad)
    out = []
    for i, s in enumerate(samples):
        if max_samples is not None and i >= max_samples:
            break
        out.append(s)
    return out


def check_op(op, kind: str, max_samples: int | None = None, executors=None) -> Result:
    """``executors``: passed to ``keraunos.jit`` (None: the default list)."""
    name = op_name(op)
    if torch.float32 not in op.supported_dtypes("cpu"):
        return Result(name, kind, "not applicable", "no float32 CPU support")
    if kind == "backward" and not op.supports_autograd:
        return Result(name, kind, "not applicable", "does not support autograd")
    if kind == "inplace" and op.inplace_variant is None:
        return Result(name, kind, "not applicable", "no inplace variant")
    try:
        samples = _samples(op, kind == "backward", max_samples)
    except Exception as e:  # noqa: BLE001 - the OpInfo itself cannot make samples here
        return Result(name, kind, "not applicable", f"no samples: {_first_line(e)}")
    if not samples:
        return Result(name, kind, "not applicable", "no float32 samples")
    checked = 0
    for index, sample in enumerate(samples):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ran = _check_sample(op, kind, sample, executors)
        except Exception as e:  # noqa: BLE001 - any failure is the op's result
            return Result(name, kind, "failed",
                          f"sample {index}: {type(e).__name__}: {_first_line(e)}")
        checked += ran
    if not checked:
        return Result(name, kind, "not applicable", "no sample applies (eager raises on all)")
    return Result(name, kind, "passed", f"{checked} samples")


def _first_line(e: Exception) -> str:
    text = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if isinstance(e, keraunos.CaptureError) and len(text) > 1:
        return text[1][:200]  # the line that says what could not be captured
    return text[0][:200] if text else ""


def _check_sample(op, kind: str, sample, executors=None) -> int:
    """Compare one sample; 0 when eager itself rejects it (nothing to compare)."""
    fn = op.inplace_variant if kind == "inplace" else op.op
    tolerance = FUSED if executors and "inductor" in executors else EXACT
    eager_in, eager_args, eager_kwargs = _clone((sample.input, sample.args, sample.kwargs))
    jit_in, jit_args, jit_kwargs = _clone((sample.input, sample.args, sample.kwargs))
    torch.manual_seed(1234)
    try:
        expected = fn(eager_in, *eager_args, **eager_kwargs)
    except Exception:  # noqa: BLE001 - eager rejects the sample: not ours to compare
        return 0
    torch.manual_seed(1234)
    actual = _call_jitted(fn, jit_in, jit_args, jit_kwargs, executors)
    if op.name in UNINITIALIZED:
        _compare_metadata(actual, expected, "output")
        return 1
    _compare(actual, expected, "output", tolerance)
    if kind == "inplace":
        _compare(jit_in, eager_in, "mutated input", tolerance)
    if kind == "backward":
        e_inputs = [t for t in _tensors((eager_in, eager_args, eager_kwargs)) if t.requires_grad]
        j_inputs = [t for t in _tensors((jit_in, jit_args, jit_kwargs)) if t.requires_grad]
        e_out = [t for t in _tensors(expected) if t.requires_grad]
        j_out = [t for t in _tensors(actual) if t.requires_grad]
        if not e_out or not e_inputs:
            return 1
        torch.manual_seed(99)
        weights = [torch.randn_like(t) for t in e_out]
        try:
            e_grads = torch.autograd.grad(e_out, e_inputs, weights, allow_unused=True)
        except Exception:  # noqa: BLE001 - eager has no gradient for this sample
            return 1
        j_grads = torch.autograd.grad(j_out, j_inputs, weights, allow_unused=True)
        _compare([g for g in j_grads if g is not None], [g for g in e_grads if g is not None],
                 "gradient", tolerance)
    return 1
