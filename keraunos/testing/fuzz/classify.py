"""Telling a wrong result from float32 rounding: a float mismatch checked against float64 eager.

When the jitted value differs from eager float32's, both may be float32 roundings of one
ill-conditioned computation (terms that cancel, sums in another order). The classifier runs the
program again up to the mismatching step twice, eagerly: once in float32 (recording what eager
did), once with float32 promoted to float64 (the *reference*), and, with fusion, once under
``torch.compile``. Then (``judge``) the mismatch is **rounding** when

  (a) elementwise ``|jit - f64| <= FACTOR * max|eager - f64| + atol + rtol * |f64|``: the jitted
      value is within the comparison's tolerance of float64, or no further from it than a small
      multiple of eager's own (tensor-wide) error; or
  (b) with fusion, the jitted value equals ``torch.compile``'s to the comparison's tolerance.

A well-conditioned program's eager error is an ulp or so, far below the tolerance a mismatch
exceeds (``rtol = 1e-4``, hundreds of ulps), so (a) keeps every wrong result of such a program a
mismatch; it accepts a jitted value only where eager's own float32 value is visibly off.

The float64 run must be the same program: only float32 is promoted. Factories draw in float32
(the same random numbers) and the result is promoted; ``.float()`` and ``dtype=torch.float32``
become float64; random fills (``uniform_``, ``nn.init``) draw into a float32 copy. Every torch call
of the float64 run is checked against the float32 run's record (the same function, dtypes equal
or float32 -> float64, returning its input alike) and ``x.dtype`` answers what eager saw, so a
branch on a dtype goes the same way; any disagreement, or an exception, leaves it a mismatch.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
from torch.overrides import TorchFunctionMode

from . import compare
from .compare import Mismatch, flatten, module_state
from . import side as _side
from .side import Outcome, Side, ambient, backward_one, call_one, globals_of
from .program import Call, Program

F32, F64 = torch.float32, torch.float64
FACTOR = 10  # how much further from float64 than eager a jitted value may be, see (a)

# Functions that make a tensor from nothing (or from a shape): they run as written, in float32,
# and their float32 result is promoted, so that the values (random ones too) are eager's.
FACTORIES = frozenset((
    "randn", "rand", "randint", "randperm", "normal", "zeros", "ones", "full", "empty", "tensor",
    "as_tensor", "arange", "linspace", "logspace", "eye", "scalar_tensor", "empty_strided",
    "zeros_like", "ones_like", "full_like", "empty_like", "randn_like", "rand_like",
    "randint_like", "new_zeros", "new_ones", "new_full", "new_empty", "new_tensor"))
# In-place random fills: a float64 tensor draws other numbers than a float32 one.
RANDOM_FILLS = frozenset(("uniform_", "normal_", "bernoulli_", "exponential_", "random_",
                          "cauchy_", "log_normal_", "geometric_"))


class _Diverged(Exception):
    """The float64 run did not do what eager float32 did: it is not the same program."""


# ------------------------------------------------------------------------- the two modes
def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for x in value for t in _tensors(x)]
    return []


def _returns_input(args, kwargs, out) -> bool:
    return any(out is a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))


def _fact(func, args, kwargs, out) -> tuple:
    """What the float64 run must reproduce of one call: the function, the dtype(s) it returned
    (or the dtype itself, for ``x.dtype``), whether it returned its input."""
    if isinstance(out, torch.dtype):
        return func, out, False
    return func, tuple(t.dtype for t in _tensors(out)), _returns_input(args, kwargs, out)


class Record(TorchFunctionMode):
    """Eager float32, recording each torch call's ``_fact``."""

    def __init__(self):
        super().__init__()
        self.facts: list[tuple] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.facts.append(_fact(func, args, kwargs, out))
        return out


def _agrees(got: torch.dtype, want: torch.dtype) -> bool:
    """Whether the float64 run's dtype is eager's, promoted: float32 (or, where eager ran
    under ``--autocast``, the reduced precision autocast gave) as float64."""
    lower = want in (torch.bfloat16, torch.float16) and _side.AMBIENT is not None
    return got == want or ((want == F32 or lower) and got == F64)


def _to_f64(value):
    """``torch.float32`` anywhere in an argument becomes ``torch.float64``."""
    if value is F32:
        return F64
    if isinstance(value, (tuple, list)) and any(_to_f64(v) is not v for v in value):
        return type(value)(_to_f64(v) for v in value)  # rebuilt only when changed
    return value


class Promote(TorchFunctionMode):
    """Float32 promoted to float64, replaying a ``Record``'s facts call by call."""

    def __init__(self, facts: list[tuple]):
        super().__init__()
        self.facts = iter(facts)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        want_func, want, was_input = next(self.facts, (None, None, None))
        if want_func is None or want_func != func:
            raise _Diverged(f"{getattr(func, '__name__', func)}: eager called "
                            f"{getattr(want_func, '__name__', want_func)}")
        if isinstance(want, torch.dtype):  # x.dtype: eager's answer, so branches go alike
            got = func(*args, **kwargs)
            if not _agrees(got, want):
                raise _Diverged(f"dtype {got}, eager {want}")
            return want
        out = self._run(func, args, kwargs, want)
        if isinstance(out, torch.Tensor) and out.dtype == F32 and want == (F32,):
            out = out.to(F64)  # e.g. an int tensor times a Python float: the default dtype
        got = tuple(t.dtype for t in _tensors(out))
        if len(got) != len(want) or not all(map(_agrees, got, want)):
            raise _Diverged(f"{getattr(func, '__name__', func)} returned {got}, eager {want}")
        if was_input != _returns_input(args, kwargs, out):
            if was_input or not isinstance(out, torch.Tensor):
                raise _Diverged(f"{getattr(func, '__name__', func)}: a new tensor, eager's input")
            out = out.clone()  # x.double() of a promoted x: eager made a copy, so must we
        return out

    @staticmethod
    def _run(func, args, kwargs, want):
        name = getattr(func, "__name__", "")
        # nn.init functions pass their tensor as the keyword ``tensor`` to __torch_function__
        first = args[0] if args else kwargs.get("tensor")
        fill = name in RANDOM_FILLS or getattr(func, "__module__", "") == "torch.nn.init"
        if (fill and isinstance(first, torch.Tensor) and first.dtype == F64
                and want[:1] == (F32,)):
            draw = first.detach().to(F32)  # eager drew these numbers in float32
            if args:
                func(draw, *args[1:], **kwargs)
            else:
                func(**dict(kwargs, tensor=draw))
            with torch.no_grad():
                first.copy_(draw)
            return first
        if name in FACTORIES:
            kwargs = dict(kwargs)
            if name.endswith("_like") and F32 in want and "dtype" not in kwargs:
                kwargs["dtype"] = F32  # drawn like eager's, from a promoted tensor
            grad = kwargs.pop("requires_grad", False)
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.dtype == F32:
                out = out.detach().to(F64)
                if grad:
                    out.requires_grad_()
            return out
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        return func(*_to_f64(tuple(args)), **{k: _to_f64(v) for k, v in kwargs.items()})


# --------------------------------------------------------------------- running one side
def _snapshot(out, named, side: Side) -> dict[str, torch.Tensor]:
    """Every compared tensor under the path the comparison names it by (``compare_tree``)."""
    found = dict(flatten(out))
    for name, t in named:
        found[name] = t
        if t.is_leaf:
            found[f"{name}.grad"] = t.grad
    found.update(module_state(side.model))
    found.update(globals_of(side))
    return {k: v.detach().clone() for k, v in found.items() if isinstance(v, torch.Tensor)}


class _Ambient:
    """``mode`` inside a fresh ``ambient()`` (``--autocast``) each time it is entered: for the
    float32 reruns, which must run as both sides ran."""

    def __init__(self, mode):
        self.mode = mode
        self.stacks: list[contextlib.ExitStack] = []

    def __enter__(self):
        stack = contextlib.ExitStack()
        stack.enter_context(ambient())
        stack.enter_context(self.mode)
        self.stacks.append(stack)
        return self

    def __exit__(self, *exc):
        return self.stacks.pop().__exit__(*exc)


def run_side(program: Program, filename: str, upto: int, after_backward: bool, mode,
             make=None) -> dict[str, torch.Tensor]:
    """Drive one side (eager under ``mode``, or ``make(f_or_model)``) through steps 0..``upto``
    like ``run_program`` does; the compared tensors after step ``upto``'s call or backward."""
    with mode:
        side = Side(program, filename, make)
    for index, step in enumerate(program.steps[:upto + 1]):
        if not isinstance(step, Call):
            with mode:
                exec(step.render(), side.env())
            continue
        with mode:
            out, named = call_one(step, side)
        if index == upto and not after_backward:
            return _snapshot(out, named, side)
        with mode:
            backward_one(flatten(out))
        if index == upto:
            return _snapshot(out, named, side)
    raise _Diverged("the mismatching step is not a call")


# ---------------------------------------------------------------------------- judging
def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a == b) | (a.isnan() & b.isnan())


def judge(eager: torch.Tensor, jitted: torch.Tensor, exact: torch.Tensor,
          compiled: torch.Tensor | None = None) -> tuple[bool, str]:
    """Is ``jitted`` rounding, by (a) or (b) of the module's docstring? And the evidence."""
    e, j, r = (t.detach().to(F64) for t in (eager, jitted, exact))
    tol = compare.ATOL + compare.RTOL * r.abs()
    finite = r.isfinite() & e.isfinite()
    eager_error = (e - r).abs().where(finite, 0.0)
    scale = float(eager_error.max()) if eager_error.numel() else 0.0
    jit_error = (j - r).abs()
    # Where float64 or eager is not finite there is no error to scale: the jitted value must be
    # float64's or eager's (an overflow, a NaN), or within tolerance of float64's.
    near = torch.where(finite, jit_error <= FACTOR * scale + tol,
                       _same(j, r) | _same(j, e) | (jit_error <= tol))
    evidence = (f"against float64 eager: max |eager f32 - f64| = {scale:.3g}, "
                f"max |jit - f64| = {_max(jit_error)}, max |f64| = {_max(r.abs())}")
    if bool(near.all()):
        return True, evidence + f" (jit within {FACTOR} x eager's error + tolerance)"
    if compiled is None:
        return False, evidence
    c = compiled.detach().to(F64)
    evidence += (f"; torch.compile: max |compile - f64| = {_max((c - r).abs())}, "
                 f"max |jit - compile| = {_max((j - c).abs())}")
    equal = torch.isclose(j, c, rtol=compare.RTOL, atol=compare.ATOL, equal_nan=True)
    return bool(equal.all()), evidence + (" (jit equals torch.compile's)" if equal.all() else "")


def _max(t: torch.Tensor) -> str:
    return f"{float(t.nan_to_num(float('inf')).max()):.3g}" if t.numel() else "0"


def classify_mismatch(program: Program, filename: str, outcome: Outcome, m: Mismatch,
                      compile_reference: bool) -> Outcome:
    """``outcome`` (a float value mismatch) as "rounding" with the evidence, or unchanged (also
    when the float64 run is not the same program or raises)."""
    after_backward = "after backward" in m.check
    try:
        with torch.random.fork_rng(), _quiet():
            record = Record()
            eager = run_side(program, filename, outcome.step, after_backward,
                             _Ambient(record))[m.path]
            exact = run_side(program, filename, outcome.step, after_backward,
                             Promote(record.facts))[m.path]
            if eager.shape != m.eager.shape or not bool(_same(eager, m.eager).all()):
                raise _Diverged("eager float32 run again gave another value")
            rounding, evidence = judge(m.eager, m.jitted, exact)
            if not rounding and compile_reference:
                compiled = run_side(program, filename, outcome.step, after_backward,
                                    _Ambient(contextlib.nullcontext()), torch.compile)[m.path]
                rounding, evidence = judge(m.eager, m.jitted, exact, compiled)
    except Exception as e:  # noqa: BLE001 - no float64 reference: the mismatch stands
        return replace(outcome, detail=outcome.detail + f"\nnot classified: {type(e).__name__}: "
                                                        f"{str(e).splitlines()[0][:200] if str(e) else ''}")
    if not rounding:
        return replace(outcome, detail=outcome.detail + "\nnot rounding: " + evidence)
    return replace(outcome, status="rounding", detail=outcome.detail + "\n" + evidence)


@contextlib.contextmanager
def _quiet():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
