"""The torch function mode that records every torch call of the program as a bound symbol."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from ..torch_internals.fake import (DataDependentOutputException, DynamicOutputShapeException,
                                   FakeTensor, UnsupportedOperatorException)
from ..torch_internals.functorch import is_functorch_wrapped_tensor
from ..core import tree
from ..core.aten import AtenRecorder, eager_batch_norm_layout

from ..core.effects import METADATA_WRITES, draws_random, is_inplace_by_name
from ..core.symbols import TorchSymbol
from ..errors import (BackwardInProgramError, CaptureError, DataDependentError, FakeKernelError,
                      FunctionTransformError, user_source)
from .backward import record_backward
from .distributed import capture_collective, is_distributed_function
from .dtensor import has_capture_dtensor, record_dtensor_call
from .interceptors import paused_watch
from .naming import torch_symbol
from ..core.symbolic import hint as size_hint


class Recorder(TorchFunctionMode):
    """Records every torch call the program makes (the mode is off inside a call, so only the
    outermost, user-level call is recorded: ``F.layer_norm``, not what it calls)."""

    records_torch_calls = True  # what interceptors look for on the mode stack

    def __init__(self, ctx):
        super().__init__()
        self.ctx = ctx

    def __torch_function__(self, func, types, args=(), kwargs=None):
        with paused_watch():
            return self._record(func, types, args, kwargs)

    def _record(self, func, types, args, kwargs):
        ctx = self.ctx
        kwargs = kwargs or {}
        if ctx.in_vmap:  # recorded below, at the ATen level (see CaptureContext.record_vmap)
            return func(*args, **kwargs)
        args, kwargs = tree.map_leaves(
            lambda x: ctx.real_tensor_reached_program(x)
            if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor)
            and id(x) not in ctx.proxy_of else x,
            (args, kwargs))
        if any(_is_functorch_wrapped(x) for x in tree.leaves((args, kwargs))):
            raise _transform_error()
        if getattr(func, "__self__", None) is torch.Tensor.grad and len(args) == 1 and \
                not has_capture_dtensor(args):  # x.grad: an input of its own when x is one
            return ctx.input_grad(args[0], func(*args))
        if getattr(func, "__self__", None) is torch.Tensor.grad and len(args) == 2 and \
                not has_capture_dtensor(args):  # x.grad = value: the epilogue writes it
            return ctx.write_grad(*args)
        if id(func) in _BACKWARD and not has_capture_dtensor(args):
            return record_backward(self, func, args, kwargs)  # a training step: backward.py
        if is_distributed_function(func):  # dist.all_reduce(t) and the like: see distributed.py
            return capture_collective(self, func, args, kwargs)
        symbol = torch_symbol(func)
        self._refuse_before_the_call(symbol, func, args, kwargs)
        if has_capture_dtensor((args, kwargs)) or ctx.dtensors.record_aten:  # see dtensor.py
            return record_dtensor_call(ctx, func, args, kwargs)
        if id(func) in _TO_PYTHON:  # specialize_data=True (else refused above)
            return ctx.specialize_on_data(symbol, func, args, kwargs)
        if func is torch.Tensor.__iter__:  # iterating a tensor is unbinding it
            return iter(self.__torch_function__(torch.Tensor.unbind, types, (args[0],), {}))
        tensors = [x for x in tree.leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        versions = [_version(t) for t in tensors]
        ctx.record_global_state()
        casts = _autocast_watch(func, tensors)
        try:
            if casts is None:
                out = func(*args, **kwargs)
            else:
                with _cast_cache_off(), casts:
                    out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            raise _data_dependent_error(symbol, e) from None
        except CaptureError:
            raise
        except Exception as e:  # the program's own error (a shape mismatch, say): eager's type
            return self._failed_call(symbol, func, args, kwargs, tensors, e)
        self._check_the_result(symbol, func, args, kwargs, tensors, out)
        if id(func) in _BATCH_NORMS:
            out = eager_batch_norm_layout(args, out)
        mutated = [t for t, v in zip(tensors, versions) if _version(t) != v]
        if not mutated and None in versions and is_inplace_by_name(symbol) and tensors:
            mutated = [tensors[0]]  # inference tensors keep no version counter
        if _returns_its_argument(symbol, out, tensors, versions, mutated, args, kwargs):
            return out
        produces_tensor = any(isinstance(x, torch.Tensor) for x in tree.leaves(out))
        under_autocast = False
        if casts is not None and any(c.func in _CASTS for c in casts.calls):
            cast = None
            if not mutated and not is_inplace_by_name(symbol) and \
                    not draws_random(symbol, args, kwargs):
                cast = _casts_of_inputs(func, casts.calls, tensors, args, kwargs, out)
            if cast is None:  # autocast cast inside the op, not (only) its inputs
                under_autocast = True
            else:
                # Autocast cast the op's inputs: the casts are lines, then the op on the cast
                # values, which computes the same wherever it runs, autocast on or off.
                for call in cast.values():
                    ctx.record(TorchSymbol(call.func, f"torch.ops.{call.func}", "function"),
                               call.args, call.kwargs, call.out, [])
                args, kwargs = tree.map_leaves(
                    lambda x: cast[id(x)].out if id(x) in cast else x, (args, kwargs))
        if produces_tensor or mutated or is_inplace_by_name(symbol) or \
                draws_random(symbol, args, kwargs):
            ctx.record(symbol, args, kwargs, out, mutated, under_autocast=under_autocast)
        return out

    def _refuse_before_the_call(self, symbol, func, args, kwargs) -> None:
        """What capture cannot record, refused with what to do: autograd hooks on tensors,
        formatting a tensor, Python values read from tensor data, data-dependent sizes."""
        if id(func) in _HOOKS:
            raise CaptureError(
                f"keraunos cannot capture {user_source()}\n  `{symbol.name}` registers an autograd "
                f"hook on a tensor inside the program; the compiled backward would not call it.\n"
                f"  What to do: register the hook on the jitted function's output, or on a "
                f"parameter, outside the jitted function.")
        if id(func) in _BACKWARD:  # of DTensors (backward.py takes the others)
            raise BackwardInProgramError(
                f"keraunos cannot capture {user_source()}\n  `{symbol.name}` runs autograd's "
                f"backward of DTensors inside the program.\n  What to do: keep the default "
                f"fallback=\"dynamo\", which runs the step with the graphs around the backward "
                f"compiled; or jit the model and run backward, clipping and the optimizer "
                f"outside it.")
        if func in _FORMATTING:
            raise _formatting_error()
        if id(func) in _TO_PYTHON and not self.ctx.specialize_data:
            raise _data_dependent_error(symbol, DataDependentOutputException(func))
        if any(isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))
               and not self.ctx.backed(x) for x in tree.leaves((args, kwargs))):
            # One trace cannot hold it; the route that splits programs can (its default).
            raise DataDependentError(
                f"keraunos cannot capture {user_source()}\n  `{symbol.name}` receives a size that "
                f"depends on tensor data (from nonzero, torch.where(mask), boolean indexing), used "
                f"as a Python number.\n  What to do: keep working with the tensor itself, or "
                f"compute that part outside the jitted function.")

    def _failed_call(self, symbol, func, args, kwargs, tensors, e: Exception):
        """The call raised on fake tensors: an op no fake kernel describes runs once for real
        (opaque); otherwise the user gets the error eager would raise."""
        ctx = self.ctx
        if _no_fake_kernel(e):
            # No kernel can describe its output without running it: run it once for real,
            # on zeros, for the output's metadata; the trace calls it like any other op.
            out = ctx.run_opaque(func, args, kwargs)
            ctx.record(symbol, args, kwargs, out, [], opaque=True)
            return out
        # A fake kernel can reject a call with another exception type than the real kernel
        # (ValueError for an impossible view, where eager raises RuntimeError): the user's
        # `except` must see eager's, so the real kernel is asked on zeros of the same layout.
        real_error = _real_kernel_error(ctx, func, args, kwargs)
        if real_error is None and any(
                t.requires_grad and t.untyped_storage()._cdata in ctx.metadata_changed_views
                for t in tensors if not _is_functorch_wrapped(t)):
            # Only the fake tensors failed (the real kernel runs): see _metadata_change_error.
            raise _metadata_change_error(symbol) from e
        if real_error is None and _fake_kernel_refuses(e):
            raise FakeKernelError(
                f"keraunos cannot capture {user_source()}\n  PyTorch's fake kernel of "
                f"`{symbol.name}` rejects this call, which its real kernel takes ({e}), so capture "
                f"cannot tell what it makes.\n  What to do: keraunos.jit(..., fallback=\"dynamo\") "
                f"(the default) runs the program through torch.compile(backend=\"keraunos\"); for "
                f"an optimizer, foreach=False is captured whole.") from None
        e = real_error or e
        source = user_source()
        if source is not None and hasattr(e, "add_note"):
            e.add_note(f"keraunos: raised by `{symbol.name}` at {source}")
        raise e from None

    def _check_the_result(self, symbol, func, args, kwargs, tensors, out) -> None:
        """After a call that ran: eager's error where a meta kernel was laxer than the real
        one, transforms' wrapped tensors refused, views whose metadata changed noted."""
        if _meta_kernel_may_be_lax(symbol, tensors, args, kwargs):
            # Meta kernels let some calls through that the real kernel rejects (a float @ double
            # matmul, subtracting a bool); the user must get eager's error, even when nothing
            # uses the result (dead code elimination would drop the line that raises).
            error = _real_kernel_error(self.ctx, func, args, kwargs)
            if error is not None:
                source = user_source()
                if source is not None and hasattr(error, "add_note"):
                    error.add_note(f"keraunos: raised by `{symbol.name}` at {source}")
                raise error from None
        if any(_is_functorch_wrapped(x) for x in tree.leaves(out)):
            # A transform entered by explicit calls (dynamo's graph of torch.func.jvp makes
            # duals with _make_dual): the same refusal as for its inputs.
            raise _transform_error()
        if func in METADATA_WRITES and tensors and tensors[0]._is_view() and \
                tensors[0].requires_grad:
            self.ctx.metadata_changed_views.add(tensors[0].untyped_storage()._cdata)


_is_functorch_tensor = is_functorch_wrapped_tensor

_BATCH_NORMS = frozenset(id(f) for f in (torch.nn.functional.batch_norm, torch.batch_norm,
                                         torch.native_batch_norm))


# ----------------------------------------------------------------------------------- autocast
# Under ``torch.autocast``, an op on its lists casts its inputs inside the call (``linear`` to
# bfloat16, ``mse_loss`` to float32): the line alone computes eager's values only where autocast
# is on, which a fused region is not. So a call made while autocast is on for its tensors'
# device is watched at the ATen level. When autocast cast the call's inputs, each cast is a line
# (``_to_copy``, where eager makes it) and the call reads the cast values: the same op then casts
# nothing, so the lines compute eager's values with autocast on or off, in a region too. The op
# stays one line, not its ATen calls: its kernel is eager's (SDPA's fused CPU kernel, which its
# decomposition on fake tensors is not). Autocast's cast cache is off while a call is watched, so
# that every cast is seen (it saves work; it changes no value). A call autocast changed some
# other way (a cast of a value made inside it), or that writes or draws, stays as it was,
# tagged ``UNDER_AUTOCAST``: it runs where autocast is on, outside regions.
_CASTS = (torch.ops.aten._to_copy.default,)
# Conversions the user asked for: autocast does not change them, and they read better as written.
_CONVERSIONS = frozenset(id(f) for f in (
    torch.Tensor.to, torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16,
    torch.Tensor.double, torch.Tensor.type, torch.Tensor.type_as))


def _autocast_watch(func, tensors):
    """An ``AtenRecorder`` for the call when autocast is on for its tensors' device (None
    otherwise)."""
    if not tensors or id(func) in _CONVERSIONS:
        return None
    devices = {t.device.type for t in tensors}
    if not any(torch.is_autocast_enabled(d) for d in devices if d in ("cpu", "cuda")):
        return None
    return AtenRecorder()


class _cast_cache_off:
    """Autocast's cast cache off on this thread (capture's, the user's), then as it was."""

    def __enter__(self):
        self.was = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)

    def __exit__(self, *exc):
        torch.set_autocast_cache_enabled(self.was)


def _casts_of_inputs(func, calls, tensors, args, kwargs, out) -> dict | None:
    """``{id(input): its cast}`` when every cast autocast made in the call was of one of the
    call's inputs, and the op on the cast values with autocast off makes what the call made
    (an op that casts an input for its own reasons, ``rms_norm`` computing in float32 and
    casting back, would not); None otherwise."""
    # Autocast's wrapper casts the inputs first, then runs the op on the casts alone; what the
    # op casts inside (SDPA's math in float32) is its own, and runs again below.
    inputs = {id(t) for t in tensors}
    cast, leading = {}, 0
    for call in calls:
        source = call.args[0] if call.args else None
        if call.func not in _CASTS or id(source) not in inputs:
            break
        first = cast.setdefault(id(source), call)  # (an input passed twice is cast twice)
        if first.kwargs.get("dtype") != call.kwargs.get("dtype"):
            return None
        leading += 1
    if not cast or any(id(x) in cast for c in calls[leading:]
                       for x in tree.leaves((c.args, c.kwargs)) if isinstance(x, torch.Tensor)):
        return None
    args, kwargs = tree.map_leaves(lambda x: cast[id(x)].out if id(x) in cast else x,
                                   (args, kwargs))
    devices = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    try:
        for d in devices:
            torch.set_autocast_enabled(d, False)
        made, expected = tree.leaves(func(*args, **kwargs)), tree.leaves(out)
        same = len(made) == len(expected) and all(
            isinstance(a, torch.Tensor) == isinstance(b, torch.Tensor) and (
                not isinstance(a, torch.Tensor) or (a.dtype, a.shape, a.stride()) ==
                (b.dtype, b.shape, b.stride())) for a, b in zip(made, expected))
    except Exception:  # noqa: BLE001 - not the same op on the cast values
        return None
    finally:
        for d in devices:
            torch.set_autocast_enabled(d, True)
    return cast if same else None


def _metadata_change_error(symbol) -> CaptureError:
    return CaptureError(
        f"keraunos cannot capture {user_source()}\n  `{symbol.name}` writes through a view of a "
        f"tensor whose metadata the program changed in place (x.unsqueeze_(0), x.t_(), ...) "
        f"while it is a view of another tensor that requires grad: PyTorch's fake tensors "
        f"replay such views without the change, so capture cannot follow it.\n  What to do: "
        f"use the functional form and a new name (y = x.unsqueeze(0); y[0, :1].neg_()), which "
        f"writes the same memory.")


def _transform_error() -> FunctionTransformError:
    return FunctionTransformError(
        f"keraunos cannot capture {user_source()}\n  it runs under a torch.func transform "
        f"(grad, vjp, jvp, jacrev, ...), which keraunos.jit does not capture into one trace "
        f"yet.\n  What to do: keraunos.jit(..., fallback=\"dynamo\") (the default) runs the "
        f"program through torch.compile(backend=\"keraunos\"), which traces it; or apply the "
        f"transform to the jitted function from outside.")


def _is_functorch_wrapped(x) -> bool:
    return isinstance(x, torch.Tensor) and _is_functorch_tensor(x)


def _returns_its_argument(symbol, out, tensors, versions, mutated, args, kwargs) -> bool:
    """Whether the call handed back one of its tensor arguments, unchanged (``x.float()`` of a
    float tensor, ``.contiguous()`` of a contiguous one, ``.to(x.device)``): such a call is no
    line of the program. Its result is the argument's proxy either way, and what made it return
    its argument (dtype, device, layout) is what the prologue checks, or a guard on sizes; a line
    kept would only cost a Python call and a dispatch per run."""
    if not isinstance(out, torch.Tensor) or not any(out is t for t in tensors):
        return False
    return not (mutated or None in versions or "out" in kwargs or is_inplace_by_name(symbol)
                or draws_random(symbol, args, kwargs))


def _subtractions() -> dict[int, object]:
    """Every torch callable that subtracts or negates: the functions, the methods, the operators
    and the ATen ops (``torch.sub``, ``x.sub_``, ``x - y``, ``torch.ops.aten.rsub``), by identity,
    since names differ by where the callable lives (``torch.sub`` is named ``torch.sub``)."""
    aten = torch.ops.aten
    packets = (aten.sub, aten.sub_, aten.rsub, aten.subtract, aten.subtract_, aten.neg,
               aten.neg_, aten.negative, aten.negative_)
    overloads = [getattr(p, name) for p in packets for name in p.overloads()]
    functions = [torch.sub, torch.subtract, torch.rsub, torch.neg, torch.negative]
    methods = [getattr(torch.Tensor, name) for name in (
        "sub", "sub_", "subtract", "subtract_", "neg", "neg_", "negative", "negative_",
        "__sub__", "__rsub__", "__isub__", "__neg__")]
    # Keyed by id (the values keep the callables alive): a callable need not be hashable.
    return {id(f): f for f in functions + methods + list(packets) + overloads}


_SUBTRACTIONS = _subtractions()


def _meta_kernel_may_be_lax(symbol, tensors, args, kwargs) -> bool:
    """Calls that meta kernels are known to accept where the real kernel raises: float dtypes
    mixed in one call, and subtraction or negation with a bool (eager: "use ~ instead")."""
    if len({t.dtype for t in tensors if t.is_floating_point()}) > 1:
        return True
    if id(symbol.fn) in _SUBTRACTIONS:
        return any(type(x) is bool or (isinstance(x, torch.Tensor) and x.dtype is torch.bool)
                   for x in tree.leaves((args, kwargs)))
    return False


_REAL_RERUN_MAX_ELEMENTS = 1 << 24  # larger calls keep the fake kernel's exception


def _real_kernel_error(ctx, func, args, kwargs) -> Exception | None:
    """The exception the real kernel raises for this call, run on zeros shaped like the fakes
    (errors that depend on shapes, strides and dtypes, which are the ones fake kernels raise);
    ``None`` when it does not raise or the call is too large to rerun."""
    tensors = [x for x in tree.leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    try:
        # Symbolic sizes at their values in this call: comparing them would add a guard.
        if sum(size_hint(t.numel()) for t in tensors) > _REAL_RERUN_MAX_ELEMENTS:
            return None
    except Exception:  # noqa: BLE001 - a size the fakes cannot tell (data-dependent)
        return None
    try:
        # Without autograd: the zeros are leaves, and autograd's own errors (an in-place write to
        # a leaf that requires grad) are raised alike by the fake kernels, which run under it.
        with torch.no_grad():
            ctx.run_opaque(func, args, kwargs, for_output=False)
    except Exception as real:  # noqa: BLE001 - whatever the real kernel raises is eager's error
        return real
    return None


def _fake_kernel_refuses(e: Exception) -> bool:
    """A fake kernel that checks a CPU scalar argument's device sees the meta device."""
    return "got meta instead" in str(e)


def _no_fake_kernel(e: Exception) -> bool:
    text = str(e)
    return isinstance(e, UnsupportedOperatorException) or "no fake impl" in text or (
        "Meta" in text and ("Could not run" in text or "not implemented" in text.lower()))


def _version(t: torch.Tensor):
    try:
        return t._version
    except RuntimeError:  # an inference tensor
        return None


# By the op objects (ids: some are unhashable descriptors) the torch function mode receives.
_HOOKS = frozenset(map(id, (torch.Tensor.register_hook,
                            torch.Tensor.register_post_accumulate_grad_hook,
                            torch.Tensor.retain_grad)))
_TO_PYTHON = frozenset(map(id, (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__,
                                torch.Tensor.__int__, torch.Tensor.__float__,
                                torch.Tensor.__index__, torch.Tensor.__complex__,
                                torch.Tensor.numpy, torch.Tensor.__array__)))


_FORMATTING = (torch.Tensor.__repr__, torch.Tensor.__format__)
_BACKWARD = frozenset(map(id, (torch.Tensor.backward, torch.autograd.backward,
                               torch.autograd.grad)))


def _formatting_error() -> DataDependentError:
    source = user_source()
    where = f"{source.filename}:{source.lineno}: {source.code}" if source else "an unknown line"
    return DataDependentError(
        f"keraunos cannot capture {where}\n  it formats a tensor's values as text (f\"{{x}}\", "
        f"str(x), repr(x), \"%s\" % x), and those values are unknown until the program runs.\n"
        f"  What to do: hand the tensor itself to print or logging (print(\"x\", x), "
        f"log.info(\"x %s\", x)): keraunos makes those calls on every call, with the values of "
        f"that call; or format it outside the jitted function, or compile with "
        f"keraunos.jit(..., fallback=\"dynamo\").")


def _data_dependent_error(symbol: TorchSymbol | None, error: Exception,
                          source=None) -> CaptureError:
    source = source or user_source()
    where = f"{source.filename}:{source.lineno}: {source.code}" if source else "an unknown line"
    if isinstance(error, DynamicOutputShapeException):
        what = f"`{symbol.name}` returns a tensor whose shape depends on tensor data"
    elif symbol is None:
        what = ("a value read from tensor data is used as a size or in a Python decision (a "
                "slice bound, a shape, if, range, a comparison)")
    elif getattr(symbol, "fn", None) is torch.Tensor.__index__:  # range(t), x[:t], torch.zeros(t): a size or an index
        what = f"a tensor is used as a size or an index (`{symbol.name}`), which needs its data"
    else:
        what = (f"`{symbol.name}` turns tensor data into a Python value (for a decision, a size "
                f"or a number)")
    return DataDependentError(
        f"keraunos cannot capture {where}\n  {what}, which is unknown until the program runs.\n"
        f"  What to do: compile it with `torch.compile(model, backend=\"keraunos\")` instead, "
        f"which splits the program at such decisions (`keraunos.jit(..., "
        f"fallback=\"dynamo\")`, the default, does that automatically); or keep the decision in tensors "
        f"(torch.where, masking), pass the value in as a Python argument, or move this part "
        f"outside the jitted function. When a few ops compute the value from the inputs (a "
        f"position, `input_pos.max().item()`), `keraunos.jit(..., specialize_data=True)` "
        f"computes it in the prologue on every call instead.")
