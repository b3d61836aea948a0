"""Functions of ``torch`` swapped during capture, in the capturing thread's eyes only.

``torch.manual_seed``/``get_rng_state``/``set_rng_state`` and ``torch.vmap`` have no
``__torch_function__``, so the recording mode cannot see them: during capture they are recorders.
``torch.autograd.Function.apply`` is guarded (a custom Function's own backward would be lost), and
``torch.compiler.is_compiling()`` is true, so that libraries take their trace-friendly paths,
and a ``torch.jit.script`` function runs as the Python function it was made from. Other threads
calling these meanwhile get the originals.
"""
from __future__ import annotations

import functools
import gc
import sys
import threading

import torch
from torch.utils import _pytree as pytree

from ..torch_internals import autograd as autograd_internals, dispatch, patching
from ..torch_internals import jit as jit_internals
from ..errors import CaptureError, CustomFunctionError, FunctionTransformError, user_source
from . import replayed
from .state import active_context


# ``torch.manual_seed`` and ``torch.get_rng_state``/``set_rng_state`` are no torch functions (no
# __torch_function__), so the mode cannot see them; during capture they are swapped for recorders
# (in this thread only) so that a program that seeds or saves and restores the generator does so
# at the same points when the trace runs.
_RNG_FUNCTIONS = ("manual_seed", "get_rng_state", "set_rng_state")
_rng_originals = {name: getattr(torch, name) for name in _RNG_FUNCTIONS}


def _rng_recorder(name: str):
    original = _rng_originals[name]

    def recorder(*args, **kwargs):
        ctx = active_context()
        if ctx is None:
            return original(*args, **kwargs)
        return ctx.record_rng(name, original, args, kwargs)
    recorder.__name__ = name
    recorder.__wrapped__ = original
    return recorder


_rng_recorders = {name: _rng_recorder(name) for name in _RNG_FUNCTIONS}


# The descriptor itself (a classmethod or a C descriptor, by torch release: ``torch_internals``).
_function_apply = autograd_internals.FUNCTION_APPLY


def _original_apply(cls, args, kwargs):
    return autograd_internals.apply_of(cls)(*args, **kwargs)


def _inside_recorded_call() -> bool:
    """True while a recorded torch call runs (the recording mode pops itself from the stack for
    that): a Function applied there is that op's own autograd (a torch.library custom op with
    register_autograd), recorded as the one op, so its backward is the op's formula, not lost."""
    return not any(getattr(mode, "records_torch_calls", False)
                   for mode in dispatch.function_modes())


def _guarded_apply(cls, *args, **kwargs):
    ctx = active_context()
    if ctx is not None and torch.is_grad_enabled() and not _inside_recorded_call() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in pytree.tree_leaves(args)):
        if (cls.__module__ or "").startswith("torch.distributed.tensor"):
            # DTensor's from_local, to_local, redistribute: their backward is part of the
            # DTensor backward capture derives (capture/dtensor_autograd.py).
            ctx.dtensors.autograd = True
            return _original_apply(cls, args, kwargs)
        raise CustomFunctionError(
            f"keraunos cannot capture {user_source()}\n  the custom autograd.Function "
            f"`{cls.__qualname__}` runs inside the program with inputs that require grad; its own "
            f"backward would be lost (torch.utils.checkpoint with use_reentrant=True and module "
            f"backward hooks work this way).\n  What to do: use "
            f"torch.utils.checkpoint(..., use_reentrant=False), register backward hooks outside "
            f"the jitted module, or call the Function outside the jitted function.")
    return _original_apply(cls, args, kwargs)


_guarded_apply_descriptor = classmethod(_guarded_apply)


_vmap_original = torch.vmap
_is_compiling_original = torch.compiler.is_compiling


def _recording_vmap(func, *vmap_args, **vmap_kwargs):
    """``torch.vmap`` during capture: the batched call is recorded as the ATen ops it runs."""
    batched = _vmap_original(func, *vmap_args, **vmap_kwargs)

    @functools.wraps(batched)
    def run(*args, **kwargs):
        ctx = active_context()
        if ctx is None or ctx.in_vmap:
            return batched(*args, **kwargs)
        return ctx.record_vmap(batched, args, kwargs)
    return run


# torch.func transforms other than vmap run the program on functorch's wrapper tensors, which
# capture's fake tensors cannot be: during capture they refuse, and keraunos.jit takes the
# fallback route (dynamo traces them).
_FUNC_TRANSFORMS = ("grad", "grad_and_value", "vjp", "jvp", "jacrev", "jacfwd", "hessian",
                    "linearize")
_func_originals = {name: getattr(torch.func, name) for name in _FUNC_TRANSFORMS}


def _refusing_transform(name: str):
    original = _func_originals[name]

    @functools.wraps(original)
    def refuse(*args, **kwargs):
        if active_context() is None:
            return original(*args, **kwargs)
        raise FunctionTransformError(
            f"keraunos cannot capture {user_source()}\n  `torch.func.{name}` is a function "
            f"transform, which keraunos.jit does not capture into one trace yet.\n  What to do: "
            f"keraunos.jit(..., fallback=\"dynamo\") (the default) runs the program through "
            f"torch.compile(backend=\"keraunos\"), which traces it; or apply the transform to the "
            f"jitted function from outside (it then runs eagerly), or use torch.autograd.grad.")
    return refuse


def _is_compiling() -> bool:
    # Libraries (transformers) take their trace-friendly paths under a compiler: so under capture
    # (unless that path failed: capture_program tries again as eager runs).
    ctx = active_context()
    return (ctx is not None and ctx.as_compiler) or _is_compiling_original()


# A function made with ``@torch.jit.script`` (transformers' DeBERTa-v2 has six) runs in the
# TorchScript interpreter, which cannot run on capture's fake tensors and whose ops the recording
# mode would not see one by one: during capture the Python function it was made from runs in its
# place (``torch.jit.script`` keeps it: ``torch_internals.jit``), and is captured like any other
# code of the program.
_script_call_original = jit_internals.SCRIPT_FUNCTION.__call__


def _script_call(self, *args, **kwargs):
    python = jit_internals.python_of(self)
    if active_context() is None or python is None:
        return _script_call_original(self, *args, **kwargs)
    return python(*args, **kwargs)


# (owner, attribute, stand-in during capture, original)
_SWAPS = [(owner, name, _rng_recorders[name], _rng_originals[name])
          for name in _RNG_FUNCTIONS for owner in (torch, torch.random)] + [
    (torch.autograd.Function, "apply", _guarded_apply_descriptor, _function_apply),
    (torch, "vmap", _recording_vmap, _vmap_original),
    (torch.func, "vmap", _recording_vmap, _vmap_original),
    (torch.compiler, "is_compiling", _is_compiling, _is_compiling_original),
    (jit_internals.SCRIPT_FUNCTION, "__call__", _script_call, _script_call_original),
] + [(torch.func, name, _refusing_transform(name), _func_originals[name])
     for name in _FUNC_TRANSFORMS] + replayed.SWAPS  # print, logging and warnings.warn: made again by the epilogue


def _not_user_code(frame) -> bool:
    module = frame.f_globals.get("__name__") or ""
    top = module.partition(".")[0]
    # sympy and mpmath run inside PyTorch's symbolic shapes, not in the program.
    return top in ("torch", "keraunos", "sympy", "mpmath") or top in sys.stdlib_module_names


# The C++ methods of torch.distributed's objects (ProcessGroup, Backend, Work, Reducer, Store,
# Logger), by id: a call of one during capture talks to other processes or changes DDP's state,
# which the trace cannot replay on later calls (the collective would run once, at capture, on
# fake tensors). Only these read-only ones may run.
_DISTRIBUTED_READS = frozenset({
    "rank", "size", "name", "group_name", "group_desc", "options", "bound_device_id",
    "_get_backend_name", "_get_backend", "_device_types", "__eq__", "__hash__", "__repr__",
})


def _distributed_methods() -> dict[int, str]:
    c10d = dispatch.distributed_c10d()
    if c10d is None:
        return {}
    methods = {}
    for cls in vars(c10d).values():
        if not isinstance(cls, type):
            continue
        for name, value in vars(cls).items():
            function = getattr(value, "__func__", value)  # pybind11 wraps methods once more
            if type(function).__name__ == "builtin_function_or_method" and (
                    name not in _DISTRIBUTED_READS):
                methods[id(function)] = f"{cls.__name__}.{name}"
    return methods


_distributed_calls = _distributed_methods()


def _refuse_distributed_call(method: str):
    where = user_source(skip_frames=3)
    owner = method.partition(".")[0]
    if owner in ("Reducer", "Logger"):
        advice = ("jit the module inside DistributedDataParallel instead: "
                  "DistributedDataParallel(keraunos.jit(model)). That order compiles the model "
                  "and leaves DDP's gradient all-reduce to DDP.")
    else:
        advice = ("use the functional collectives of torch.distributed._functional_collectives "
                  "(all_reduce, all_gather_tensor, reduce_scatter_tensor, ...), whose results "
                  "are values the trace holds, or call the collective outside the jitted "
                  "function.")
    raise CaptureError(
        f"keraunos cannot capture {where}\n  it calls torch.distributed's {method}, which "
        f"communicates with other processes or changes distributed state; the trace could not "
        f"replay it on later calls, so it would silently not happen.\n  What to do: {advice}")


def _on_python_call(frame, event, arg):
    """Every Python function the program calls has its globals and closure guarded (once);
    a C++ method of torch.distributed's objects is refused (see ``_distributed_calls``)."""
    if event != "call":
        if event == "c_call" and _distributed_calls:
            method = _distributed_calls.get(id(arg))
            if method is not None and active_context() is not None:
                _refuse_distributed_call(method)
        return
    ctx = active_context()
    code = frame.f_code
    if ctx is None or code in ctx.helper_codes:
        return
    ctx.helper_codes.add(code)
    if not _not_user_code(frame):
        ctx.guard_helper_scope(frame)


class paused_watch:
    """The watch on Python calls, off for the duration of a recorded torch call: what runs
    inside one is PyTorch's (fake kernels, decompositions, pytree), not the program's helpers,
    and it is nearly all of a capture's Python calls (190,000 on the example GPT)."""

    __slots__ = ("hook",)

    def __enter__(self):
        self.hook = None
        if sys.getprofile() is _on_python_call:
            self.hook = sys.setprofile
        elif sys.gettrace() is _on_python_call:
            self.hook = sys.settrace
        if self.hook is not None:
            self.hook(None)

    def __exit__(self, *exc):
        if self.hook is not None:
            self.hook(_on_python_call)


# Captures under way, on any thread (nested ones too): the collector's callbacks are wrapped
# while there is one (``gc.callbacks`` is the process's).
_captures_under_way = [0]
_captures_lock = threading.Lock()


def _outside_the_program(callback):
    """A ``gc.callbacks`` function as it runs during a capture: unwatched. The collector calls
    it wherever an allocation happens to trigger a collection, so it is not a function the
    program calls: guarding its globals, or taking its writes for the program's, would refuse
    (or, worse, mis-guard) a program for what the collector did."""
    @functools.wraps(callback)
    def run(phase, info):
        with paused_watch():
            return callback(phase, info)
    run.__keraunos_gc_callback__ = callback
    return run


class intercepting_torch:
    """Swap the functions above for their stand-ins for the duration of a capture, and watch
    the Python functions the program calls (``sys.setprofile``, unless a profiler holds it: then
    ``sys.settrace``, unless a debugger holds that too); the garbage collector's callbacks run
    unwatched meanwhile (``_outside_the_program``)."""

    def __enter__(self):
        patching.swap_in(_SWAPS)
        with _captures_lock:
            _captures_under_way[0] += 1
            gc.callbacks[:] = [cb if hasattr(cb, "__keraunos_gc_callback__")
                               else _outside_the_program(cb) for cb in gc.callbacks]
        self.hook = None
        if sys.getprofile() is None:
            self.hook = sys.setprofile
        elif sys.gettrace() is None:
            self.hook = sys.settrace
        if self.hook is not None:
            self.hook(_on_python_call)

    def __exit__(self, *exc):
        if self.hook is not None:
            self.hook(None)
        patching.swap_out(_SWAPS)
        with _captures_lock:
            _captures_under_way[0] -= 1
            if not _captures_under_way[0]:
                gc.callbacks[:] = [getattr(cb, "__keraunos_gc_callback__", cb)
                                   for cb in gc.callbacks]
