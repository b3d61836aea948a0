"""What ``keraunos.jit`` returns: ``JittedFunction``, ``JittedModule``, and the wrappers for
DistributedDataParallel and FSDP2 models; ``jit()`` itself.

A ``JittedModule`` presents the original module's interface (its class name, ``forward``'s
signature, parameters, state dict, every method routed through the compiled forward) and calls
``runtime/call.py``'s call path; hooks registered on the wrapper itself (FSDP2's) run around it through
``nn.Module.__call__``. DDP and FSDP2 models are compiled around their wrappers' own eager
bookkeeping (``_jit_ddp``, ``_jit_fsdp``).
"""
from __future__ import annotations

import dataclasses

import functools
import inspect
import sys
import threading
import time
import weakref
from typing import Callable, Sequence

import torch

from .cache import CacheMode
from ..capture.state import active_context
from . import native
from .call import (CHECK_RESULTS, Fallback, JitOptions, ProgramRaised, _fsdp_units, _JitState,
    _sync_native, _warn_at_user_line, call, call_past_hit_path, call_profiled, checked_result,
    reraise)
from .tiers import FuseMode
from ..transforms import Transform

# ------------------------------------------------------------------------- public wrappers
class JittedFunction:
    """A function compiled by ``keraunos.jit``; call it as you would the original.

    Each instance has a class of its own for life, a subclass with the same names made at
    construction: once the native hit path is loaded (``keraunos/runtime/native``; at once on a
    set-up machine), that class's ``__call__`` is a ``native.Front``, a C callable that serves
    the front entry's hits (when its prologue is one it can check) and calls the ``__call__``
    below for everything else (``_go_native``)."""

    def __new__(cls, fn: Callable, options: JitOptions):
        if cls is not JittedFunction:
            return object.__new__(cls)
        if options.profile:
            return object.__new__(_ProfiledJittedFunction)
        base = _CheckedJittedFunction if CHECK_RESULTS else JittedFunction
        own = type(base.__name__, (base,), {"__slots__": (), "__module__": base.__module__,
                                            "__qualname__": base.__qualname__,
                                            "__doc__": base.__doc__})
        return object.__new__(own)

    def __init__(self, fn: Callable, options: JitOptions):
        self._keraunos = _JitState(fn, None, options)
        self._call = call_profiled if options.profile else call
        functools.update_wrapper(self, fn)
        if not options.profile:
            native.LOADER.when_loaded(self, _go_native)

    def __call__(self, *args, **kwargs):
        # jit.call's first lines, made here: a frame less on every call (jit.call says why).
        state = self._keraunos
        entries = state.entries
        if entries:
            try:
                r = entries[0].hit_fn(args, kwargs)
            except Exception:  # noqa: BLE001
                r = None  # the checks could not run on this call: "not this entry"
            if type(r) is tuple:
                next(state.hit_count)
                return r[0]
            if type(r) is ProgramRaised:
                reraise(r)  # the program's own error, from its computation or epilogue
        return call_past_hit_path(state, args, kwargs)

    def __repr__(self) -> str:
        return f"keraunos.jit({self._keraunos.fn!r})"


class _ProfiledJittedFunction(JittedFunction):
    """``profile=True``: each step of a call in a profiler range (``jit.call_profiled``)."""

    def __call__(self, *args, **kwargs):
        return self._call(self._keraunos, args, kwargs)


class _CheckedJittedFunction(JittedFunction):
    """``KERAUNOS_CHECK_RESULTS=1`` (the test suite): every result searched for capture's
    FakeTensors, after the call ``JittedFunction`` makes."""

    def __call__(self, *args, **kwargs):
        return checked_result(self._keraunos, JittedFunction.__call__(self, *args, **kwargs))


def _go_native(jitted: JittedFunction) -> None:
    """Serve ``jitted``'s calls through the native hit path from now on: its own class's
    ``__call__`` becomes a ``native.Front`` falling back to ``JittedFunction``'s (under
    ``KERAUNOS_CHECK_RESULTS``, a Python ``__call__`` that calls the ``Front`` and checks the
    result). Runs where the module loaded: at ``jit()``, or on the build's thread."""
    own = type(jitted)
    if "__call__" in own.__dict__ or own.__bases__ not in ((JittedFunction,),
                                                          (_CheckedJittedFunction,)):
        return  # profiled, or already native
    state = jitted._keraunos
    front = native.module().Front(JittedFunction.__call__, state.hit_count)
    if own.__bases__ == (JittedFunction,):
        served = front
    else:
        def served(self, *args, **kwargs):
            return checked_result(self._keraunos, front(self, *args, **kwargs))
    with state.lock:
        own.__call__ = served
        state.native_front = front
    _sync_native(state)


class JittedModule(torch.nn.Module):
    """A module compiled by ``keraunos.jit``. It shares the original's parameters and buffers
    (an optimizer built on either updates both) and forwards attribute access, ``state_dict``,
    ``train()``/``eval()`` and the rest to it.

    It presents the original's interface to libraries that inspect a model:

    - ``forward`` and ``__call__`` carry the original ``forward``'s signature
      (``inspect.signature(jitted.forward)`` lists ``input_ids, attention_mask, labels, ...``),
      and the jitted module's class is a subclass of ``JittedModule`` made per original class,
      whose ``__name__`` and ``forward`` signature are the original's (Hugging Face's ``Trainer``
      derives its dataset columns and label names from them; ``type(jitted).__qualname__`` reads
      ``JittedModule[Original]``).
    - The methods rule: any other method of the original (``predict``, ``encode``, ``generate``)
      runs with the original's ``forward`` routed through the compiled program, so a method that
      calls ``self(...)`` or ``self.forward(...)`` hits the cache as a call of the jitted module
      does. Outside such a call the original module stays as it was: calling it runs eagerly.
    - As a submodule of another module, its state dict has the original's keys (no
      ``_orig_mod.``), and loads from them.

    Each instance has a class of its own for life, a subclass of that per-original class with
    the same names, whose ``__call__`` alone changes: to a ``native.Front`` once the native hit
    path is loaded (``keraunos/runtime/native``) while no call hooks or distributed wrapper take
    part (``_go_native_module``), to ``nn.Module.__call__`` when call hooks are registered on
    the wrapper (``_run_call_hooks``).
    """

    def __new__(cls, module: torch.nn.Module, options: JitOptions):
        if cls is not JittedModule:
            return super().__new__(cls)
        base = _jitted_class(module)
        return super().__new__(type(base.__name__, (base,), {
            "__module__": base.__module__, "__qualname__": base.__qualname__,
            "__doc__": base.__doc__}))

    def __init__(self, module: torch.nn.Module, options: JitOptions):
        super().__init__()
        object.__setattr__(self, "_own_class", type(self))  # a library may subclass it later
        self._orig_mod = module
        state = _JitState(module.forward, module, options)
        object.__setattr__(self, "_keraunos", state)
        object.__setattr__(self, "_call", call_profiled if options.profile else call)
        self.register_load_state_dict_pre_hook(_keys_of_the_original)
        if not options.profile:
            native.LOADER.when_loaded(self, _go_native_module)

    def __call__(self, *args, **kwargs):
        return self._call(self._keraunos, args, kwargs)

    forward = __call__

    def __getattr__(self, name: str):
        if name == "_orig_mod":
            return self._modules["_orig_mod"]
        orig = self._modules["_orig_mod"]
        value = getattr(orig, name)
        if inspect.ismethod(value) and value.__self__ is orig:
            return _through_compiled_forward(self, name, value)
        return value

    def __setattr__(self, name: str, value) -> None:
        # ``__class__``: a library that extends the wrapper's class (``fully_shard`` swaps in
        # ``FSDP<cls>``) means the wrapper, not the original.
        if name == "_orig_mod" or name == "training" or name == "__class__":
            super().__setattr__(name, value)
            if name == "__class__" and _is_fsdp_unit(self):
                _join_family(self._keraunos)
        else:
            setattr(self._orig_mod, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._orig_mod, name)

    def __repr__(self) -> str:
        return f"keraunos.jit({self._orig_mod!r})"

    def __dir__(self):
        return sorted(set(dir(self._orig_mod)) | set(super().__dir__()))

    # Container modules (Sequential, ModuleList, ModuleDict) index, measure and iterate as before.
    def __getitem__(self, index):
        return self._orig_mod[index]

    def __len__(self) -> int:
        return len(self._orig_mod)

    def __bool__(self) -> bool:  # a module is true even when it defines no __len__
        return True

    def __iter__(self):
        return iter(self._orig_mod)

    def __contains__(self, item) -> bool:
        return item in self._orig_mod

    # A copy is a jitted copy of the original, with an empty cache.
    def __deepcopy__(self, memo):
        import copy
        return JittedModule(copy.deepcopy(self._orig_mod, memo), self._keraunos.options)

    def __reduce__(self):
        return (_rejit, (self._orig_mod, self._keraunos.options))

    # The module's own views of its state, without the "_orig_mod." prefix.
    def state_dict(self, *args, **kwargs):
        return self._orig_mod.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self._orig_mod.load_state_dict(*args, **kwargs)

    def named_parameters(self, *args, **kwargs):
        return self._orig_mod.named_parameters(*args, **kwargs)

    def parameters(self, recurse: bool = True):
        return self._orig_mod.parameters(recurse)

    def named_buffers(self, *args, **kwargs):
        return self._orig_mod.named_buffers(*args, **kwargs)

    def buffers(self, recurse: bool = True):
        return self._orig_mod.buffers(recurse)

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        """The original's modules; the wrapper itself comes first, at the same name, once a
        composable distributed API (``fully_shard``, ``replicate``, ``checkpoint``) holds
        state on it: FSDP2's root finds every unit's state by walking ``named_modules()``."""
        if _composable_state_on(self):
            if memo is None:
                memo = set()
            if self not in memo:
                if remove_duplicate:
                    memo.add(self)
                yield prefix, self
        yield from self._orig_mod.named_modules(memo, prefix, remove_duplicate)

    def modules(self):
        for _, module in self.named_modules():
            yield module

    def named_children(self):
        return self._orig_mod.named_children()

    def children(self):
        return self._orig_mod.children()

    def train(self, mode: bool = True):
        super().__setattr__("training", mode)
        self._orig_mod.train(mode)
        return self

    # Call hooks registered on the wrapper itself (FSDP2's all-gather and reshard, a
    # composable checkpoint's, the user's) run around the compiled program: the first one
    # registered makes its own class's ``__call__`` ``nn.Module.__call__`` (hooks, then
    # ``forward``, the compiled program). Without any, ``__call__`` stays the
    # direct call of the program. Hooks of the original module are part of the program.
    def register_forward_pre_hook(self, *args, **kwargs):
        _run_call_hooks(self)
        return super().register_forward_pre_hook(*args, **kwargs)

    def register_forward_hook(self, *args, **kwargs):
        _run_call_hooks(self)
        return super().register_forward_hook(*args, **kwargs)

    def register_full_backward_pre_hook(self, *args, **kwargs):
        _run_call_hooks(self)
        return super().register_full_backward_pre_hook(*args, **kwargs)

    def register_full_backward_hook(self, *args, **kwargs):
        _run_call_hooks(self)
        return super().register_full_backward_hook(*args, **kwargs)

    def register_backward_hook(self, *args, **kwargs):
        _run_call_hooks(self)
        return super().register_backward_hook(*args, **kwargs)


_jitted_classes: "weakref.WeakKeyDictionary[type, type]" = weakref.WeakKeyDictionary()


def _jitted_class(module: torch.nn.Module) -> type:
    """The ``JittedModule`` subclass for ``module``: its ``forward`` and ``__call__`` take the
    original ``forward``'s signature and its ``__name__`` is the original class's, because
    libraries read both off a model (Hugging Face's ``Trainer`` keeps only the dataset columns
    that ``forward`` names, and finds label names in ``type(model).forward``). One per original
    class, or one per module whose instance has a ``forward`` of its own."""
    cls = type(module)
    own_forward = "forward" in module.__dict__
    if not own_forward and cls in _jitted_classes:
        return _jitted_classes[cls]

    def forward(self, *args, **kwargs):
        return self._call(self._keraunos, args, kwargs)
    forward.__signature__ = _signature_with_self(module.forward)
    forward.__doc__ = getattr(module.forward, "__doc__", None)
    forward.__qualname__ = f"JittedModule[{cls.__qualname__}].forward"
    jitted_cls = type(cls.__name__, (JittedModule,), {
        "forward": forward, "__call__": forward, "__module__": __name__,
        "__qualname__": f"JittedModule[{cls.__qualname__}]", "__doc__": JittedModule.__doc__})
    if not own_forward:
        _jitted_classes[cls] = jitted_cls
    return jitted_cls


def _run_call_hooks(jitted: JittedModule) -> None:
    """From now on ``jitted``'s calls run ``nn.Module``'s call hooks: its own class's
    ``__call__`` becomes ``nn.Module.__call__`` (hooks, then ``forward``, the compiled program).
    Under the state's lock: the native build's thread may be setting it too
    (``_go_native_module``), and the hooks must win."""
    state = jitted._keraunos
    with state.lock:
        jitted._own_class.__call__ = torch.nn.Module.__call__
        state.native_front = None


def _go_native_module(jitted: JittedModule) -> None:
    """``_go_native`` for a module: its own class's ``__call__`` becomes a ``native.Front``
    falling back to the Python call. A module whose calls run hooks (``_run_call_hooks``), whose
    class a library switched (``fully_shard``), or a wrapper whose calls go another way
    (``_jit_ddp``'s, through DDP's forward: its ``_call`` is not ``jit.call``) keeps the Python
    call."""
    state = jitted._keraunos
    own = jitted._own_class
    with state.lock:
        if "__call__" in own.__dict__ or type(jitted) is not own \
                or jitted.__dict__.get("_call") is not call or _composable_state_on(jitted):
            return
        fallback = own.__call__  # the per-original class's: its signature is the forward's
        front = native.module().Front(fallback, state.hit_count)
        if CHECK_RESULTS:
            @functools.wraps(fallback)
            def served(self, *args, **kwargs):
                return checked_result(self._keraunos, front(self, *args, **kwargs))
            own.__call__ = served
        else:
            own.__call__ = front
        state.native_front = front
    _sync_native(state)


def _composable_state_on(module: torch.nn.Module) -> bool:
    """Whether a composable distributed API (``torch.distributed._composable.contract``:
    ``fully_shard``, ``replicate``, ``checkpoint``) was applied to ``module`` itself."""
    contract = sys.modules.get("torch.distributed._composable.contract")
    return contract is not None and bool(module.__dict__.get(contract.REGISTRY_KEY))


def _signature_with_self(bound_forward: Callable) -> inspect.Signature:
    """``bound_forward``'s signature with a ``self`` parameter first, as a method defines it."""
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    try:
        signature = inspect.signature(bound_forward)
    except (TypeError, ValueError):  # a forward defined in C: no signature to show
        return inspect.Signature([self_param,
                                  inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
                                  inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
    if "self" in signature.parameters:  # a forward with a parameter named self: keep it visible
        self_param = self_param.replace(name="_jitted_self")
    return signature.replace(parameters=[self_param, *signature.parameters.values()])


def _keys_of_the_original(module, state_dict, prefix, *_):
    """Loading a jitted submodule: the state dict holds the original's keys (``prefix +
    'fc.weight'``, as ``state_dict`` writes them and an eager model's checkpoint holds them),
    while ``load_state_dict`` walks ``_modules`` and looks for ``prefix + '_orig_mod.fc.weight'``:
    rename them in place."""
    inner = prefix + "_orig_mod."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


def _through_compiled_forward(jitted: JittedModule, name: str, method: Callable) -> Callable:
    """The original module's ``method`` (``generate``, ``predict``, ``encode``...), with its calls
    of the module (``self(...)``, ``self.forward(...)``) routed through the compiled program while
    it runs: bound to the original, the method would call the original forward and silently run
    eagerly. A generator method is routed while each of its steps runs."""
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def steps(*args, **kwargs):
            if _eager_because_of_hooks(jitted, name):
                return method(*args, **kwargs)
            return _routed_steps(jitted, method(*args, **kwargs))
        return steps

    @functools.wraps(method)
    def run(*args, **kwargs):
        if _eager_because_of_hooks(jitted, name):
            return method(*args, **kwargs)
        with _forward_routed(jitted):
            return method(*args, **kwargs)
    return run


def _eager_because_of_hooks(jitted: JittedModule, name: str) -> bool:
    """Whether ``name`` must run eagerly (warned once per method) because the module has call
    hooks: the method calls the module, which runs its hooks, then the routed forward, whose
    program was captured from a call of the module and so runs them too: they would run twice."""
    if not _top_level_hooks(jitted._orig_mod):
        return False
    warned = jitted._keraunos.__dict__.setdefault("warned_hooks", set())
    if name not in warned:
        warned.add(name)
        _warn_at_user_line(
            f"keraunos: {jitted._keraunos.name}.{name} runs eagerly: the module has forward or "
            f"backward hooks of its own (or global ones), which the compiled program already "
            f"runs. Jit the model without them, or remove the hooks.", stacklevel=4)
    return True


def _routed_steps(jitted: JittedModule, generator):
    """Runs ``generator`` one step at a time with the forward routed, passing ``send`` and
    ``throw`` through; between steps the caller's code sees the original module unchanged."""
    sent, thrown = None, None
    while True:
        with _forward_routed(jitted):
            try:
                item = generator.throw(thrown) if thrown is not None else generator.send(sent)
            except StopIteration as stop:
                return stop.value
        sent, thrown = None, None
        try:
            sent = yield item
        except GeneratorExit:
            generator.close()
            raise
        except BaseException as e:  # noqa: BLE001 - thrown into us: the method decides
            thrown = e


_routing_lock = threading.Lock()


class _forward_routed:
    """While any thread is inside a method of the jitted module (``generate``, ``predict``...),
    the original module's ``forward`` (in its ``__dict__``) runs the compiled program; the first
    thread in installs it, the last one out restores what was there (counted, so threads cannot
    interleave a save and a restore)."""

    def __init__(self, jitted: JittedModule):
        self.jitted = jitted

    def __enter__(self):
        state, orig = self.jitted._keraunos, self.jitted._orig_mod
        with _routing_lock:
            if state.routing_depth == 0:
                state.saved_forward = orig.__dict__.get("forward")
                forward = orig.forward
                jitted = self.jitted

                def compiled_forward(*a, **k):  # capture itself calls the module: the original
                    if active_context() is not None:
                        return forward(*a, **k)
                    return jitted(*a, **k)  # with the wrapper's own hooks, if it has any
                orig.__dict__["forward"] = functools.wraps(forward)(compiled_forward)
            state.routing_depth += 1

    def __exit__(self, *exc):
        state, orig = self.jitted._keraunos, self.jitted._orig_mod
        with _routing_lock:
            state.routing_depth -= 1
            if state.routing_depth == 0:
                if state.saved_forward is None:
                    orig.__dict__.pop("forward", None)
                else:
                    orig.__dict__["forward"] = state.saved_forward


_GLOBAL_CALL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks",
                      "_global_backward_hooks", "_global_backward_pre_hooks")
_CALL_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")


def _top_level_hooks(module: torch.nn.Module) -> bool:
    """Whether calling the module runs hooks around its forward (its own or global ones)."""
    modules = torch.nn.modules.module
    return any(getattr(modules, name, None) for name in _GLOBAL_CALL_HOOKS) or any(
        module.__dict__.get(name) for name in _CALL_HOOKS)


def _rejit(module, options):
    return JittedModule(module, options)


def jit(fn_or_module: Callable | torch.nn.Module, *, executors: Sequence | None = None,
        transforms: Sequence[Transform] | None = None, cache: str | CacheMode = "constant values",
        max_cache_entries: int = 8, profile: bool | None = None,
        specialize_data: bool = False, fallback: str | Fallback = "dynamo",
        dynamic: bool | None = None, fuse: str | None = None):
    """Compile a function of tensors or an ``nn.Module``; the result is called like the original.

    The first call captures the program into traces, transforms and compiles them, and caches the
    result; later calls run a prologue that checks the inputs and reuse the cached program, or
    compile a new entry when a check fails.

    >>> import torch, keraunos
    >>> jf = keraunos.jit(lambda x, y: torch.nn.functional.gelu(x @ y + 1).sum(-1))
    >>> x, y = torch.randn(4, 8), torch.randn(8, 8)
    >>> torch.testing.assert_close(jf(x, y), torch.nn.functional.gelu(x @ y + 1).sum(-1))
    >>> print(keraunos.last_traces(jf)[-1])  # doctest: +SKIP

    Args:
        executors: who runs the operations, in order of preference (names or ``Executor``s);
            default ``["inductor", "torch"]``: fused regions where they pay, compiled as
            ``fuse`` says, the torch executor for the rest.
        fuse: how the fusion executors' regions are compiled (see ``keraunos/runtime/tiers.py``):
            ``"background"`` (default, or ``KERAUNOS_FUSE``): the first call runs at once on the
            torch executor while the fused program compiles on a background thread, and later
            calls switch to it (``keraunos.wait_for_fusion`` waits for it); programs too small
            to gain from fusion are not fused. ``"wait"``: the first call waits for the fused
            program (also what ``"background"`` does under
            ``torch.use_deterministic_algorithms(True)``). ``"off"``: no fusion.
        transforms: ``keraunos.Transform`` instances whose hooks run at fixed points.
        cache: ``"constant values"`` (default: sizes and Python numbers are compiled in and
            checked; a size or int that changes between calls is compiled as a symbol on the next
            compilation, so one more entry serves all its later values), ``"symbolic values"``
            (every size and int argument is a symbol from the first call on; the prologue checks
            the guards the capture recorded), ``"same input"`` or ``"no caching"``.
        max_cache_entries: entries kept per jitted callable; past it the least recently used goes.
        profile: wrap each call step in a profiler range (default: ``KERAUNOS_PROFILE=1``).
        specialize_data: instead of raising ``CaptureError`` when the program reads a Python value
            from tensor data (``.item()``, ``if t.any():``), compute it from the inputs in the
            prologue on every call: compiled in as a constant and checked (a new value
            recompiles), except an int whose value changed between compilations (or any int, in
            ``cache="symbolic values"``), which becomes a size symbol, its decisions guards (a
            position in a KV cache: one entry while the window fills, one once it is full).
        dynamic: in the default cache mode, ``None`` (default) compiles a size or int argument
            that changed between calls as a symbol (automatic dynamic); ``False`` never does (one
            entry per set of sizes); ``True`` makes every size and int argument a symbol from the
            first call on, as ``cache="symbolic values"`` does.
        fallback: on such a decision (without ``specialize_data``), or a ``torch.func``
            transform inside the program: ``"dynamo"`` (default) warns once, naming the line and
            how to keep the program in one trace, and runs it through
            ``torch.compile(backend="keraunos")`` instead (graph breaks at such decisions);
            ``"error"`` raises the ``CaptureError`` (a ``DataDependentError``) naming the line.
    """
    if isinstance(fn_or_module, (JittedFunction, JittedModule)):
        raise TypeError("keraunos.jit: this callable is already jitted")
    if not callable(fn_or_module):
        raise TypeError(f"keraunos.jit: expected a function or an nn.Module, got "
                        f"{type(fn_or_module).__qualname__}")
    if isinstance(fn_or_module, type):
        # Calling a class builds an object during capture, from capture's fake tensors.
        what = "an nn.Module class" if issubclass(fn_or_module, torch.nn.Module) else "a class"
        raise TypeError(
            f"keraunos.jit: got {what}, {fn_or_module.__qualname__}, not an instance; its "
            f"objects would be built from capture's fake tensors. Build the object first and "
            f"jit that: keraunos.jit({fn_or_module.__name__}(...)).")
    options = JitOptions.validated(
        executors=executors, transforms=transforms, cache=cache,
        max_cache_entries=max_cache_entries, profile=profile, specialize_data=specialize_data,
        fallback=fallback, dynamic=dynamic, fuse=fuse)
    if _is_ddp(fn_or_module):
        return _jit_ddp(fn_or_module, _distributed(options))
    if isinstance(fn_or_module, torch.nn.Module) and _fsdp_units(fn_or_module):
        return _jit_fsdp(fn_or_module, _distributed(options))
    if isinstance(fn_or_module, torch.nn.Module):
        jitted = JittedModule(fn_or_module, options)
        for t in options.transforms:
            t.transform_module(jitted)
        return jitted
    return JittedFunction(fn_or_module, options)


def _distributed(options: JitOptions) -> JitOptions:
    """DDP and FSDP2 wrappers run the torch executor unless fusion was asked to wait: a fused
    tier switching in between the ranks' steps is not tested yet (each rank would switch at its
    own call, with its own kernels), so the background default does not apply to them."""
    if options.fuse is not FuseMode.BACKGROUND:
        return options
    return dataclasses.replace(options, fuse=FuseMode.OFF, executors=tuple(
        e for e in options.executors if not getattr(e, "is_fusion", False)))


def _is_ddp(module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.nn.parallel import DistributedDataParallel
    return isinstance(module, DistributedDataParallel)


def _jit_ddp(ddp: torch.nn.Module, options: JitOptions) -> "JittedModule":
    """``keraunos.jit(DistributedDataParallel(m))``: means what ``DistributedDataParallel(
    keraunos.jit(m))`` means. DDP's own forward (its reducer's bookkeeping, buffer syncs,
    ``no_sync()``) runs eagerly on every call, as it is; the module it wraps is jitted, and DDP
    calls the jitted one in its place for the duration of the call. Introspection
    (``last_traces``, ``cache_hits``) reads the wrapped module's entries."""
    inner = JittedModule(ddp.module, options)
    for t in options.transforms:
        t.transform_module(inner)
    jitted = JittedModule(ddp, options)

    def call_through_ddp(state, args, kwargs):
        wrapped = ddp._modules["module"]
        ddp._modules["module"] = inner
        try:
            return ddp(*args, **kwargs)
        finally:
            ddp._modules["module"] = wrapped
    object.__setattr__(jitted, "_keraunos", inner._keraunos)
    object.__setattr__(jitted, "_call", call_through_ddp)
    return jitted



# ------------------------------------------------------------------------------- FSDP2
# The jitted modules ``fully_shard`` made units of (``fully_shard(keraunos.jit(block))``), by the
# class of the module they compile: identical blocks share one program.
_families: "weakref.WeakKeyDictionary[type, weakref.WeakSet]" = weakref.WeakKeyDictionary()


def _is_fsdp_unit(module: torch.nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def _join_family(state: _JitState) -> None:
    family = _families.setdefault(type(state.module), weakref.WeakSet())
    family.add(state)
    state.siblings = family


class _UnitsState(_JitState):
    """What ``keraunos.jit`` of a ``fully_shard``ed model reports: its compiled units' caches
    together (hits and misses summed, the traces of the unit that compiled or ran last)."""

    def __init__(self, module, options: JitOptions, units: list):
        super().__init__(module.forward, module, options)
        self.units = units  # the compiled units' states, in module order

    hits = property(lambda self: sum(u.hits for u in self.units), lambda self, v: None)
    misses = property(lambda self: sum(u.misses for u in self.units), lambda self, v: None)

    @property
    def last_entry(self):
        ran = [u for u in self.units if u.last_entry is not None]
        return max(ran, key=lambda u: u.last_used).last_entry if ran else None

    @last_entry.setter
    def last_entry(self, value):
        pass


def _jit_fsdp(model: torch.nn.Module, options: JitOptions) -> JittedModule:
    """``keraunos.jit`` of a model with ``fully_shard`` units (FSDP2). FSDP2's hooks are
    kept out of dynamo (its ``disable``): they all-gather, reshard, cast for mixed precision and
    reduce-scatter gradients, and must run eagerly, as they do under ``torch.compile``. Capture
    has no graph breaks, so what is compiled is each *innermost* unit's own ``forward`` (a unit
    with no unit inside it, e.g. each transformer block), captured from the forward itself, not
    from a call of the module: ``nn.Module.__call__`` runs FSDP2's hooks eagerly around it, and
    the compiled program sees the unsharded parameters (plain tensors) that the pre-forward hook
    registered. The rest (the root unit's own code between its units: embeddings, final norm,
    head) runs eagerly. The units are compiled in place: each one's ``forward`` is its compiled
    program from now on, whoever calls it (FSDP's activation-checkpoint recomputation in the
    backward, the model called directly), as ``nn.Module.compile()`` does."""
    units = _fsdp_units(model)
    jitted_units = [u for u in units if isinstance(u, JittedModule)]
    if jitted_units:
        raise TypeError(
            "keraunos.jit: this fully_shard'ed model has units that are jitted already "
            f"({type(jitted_units[0]).__qualname__}); jit either the blocks before fully_shard "
            "(fully_shard(keraunos.jit(block))) or the sharded model, not both.")
    innermost = [u for u in units
                 if not any(v is not u and v in units for v in u.modules())]
    states = []
    for unit in innermost:
        if "forward" in unit.__dict__ and getattr(unit.__dict__["forward"], "_keraunos_unit",
                                                  None) is not None:
            states.append(unit.__dict__["forward"]._keraunos_unit)  # jitted before: same cache
            continue
        state = _JitState(unit.forward, unit, options)
        state.forward_only = True
        run = call_profiled if options.profile else call

        def compiled_forward(*args, _state=state, _run=run, **kwargs):
            _state.last_used = time.perf_counter()
            return _run(_state, args, kwargs)
        compiled_forward = functools.wraps(unit.forward)(compiled_forward)
        compiled_forward._keraunos_unit = state
        unit.__dict__["forward"] = compiled_forward
        states.append(state)
    family = weakref.WeakSet(states)
    for state in states:  # identical units share one program (jit._entry_of_an_identical_unit)
        state.siblings = family
    jitted = JittedModule(model, options)
    object.__setattr__(jitted, "_keraunos", _UnitsState(model, options, states))
    object.__setattr__(jitted, "_call", lambda state, args, kwargs: model(*args, **kwargs))
    return jitted
