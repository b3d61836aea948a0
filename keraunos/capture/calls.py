"""The calls part of the capture context: recording the torch calls the program makes.

It owns the computation as it is recorded: its lines (``bound_symbols``, each with the module
calls it was made in), the storages the program wrote in place (and whether with grad mode on),
the switches of grad mode and autocast the program makes, the calls replayed after each run
(``print``, logging), and the ATen-level recording of ``torch.vmap``-ed functions. Ops without a
fake kernel run once on zeros (``run_opaque``).
"""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from ..torch_internals.dispatch import DisableTorchFunction
from ..core import tree
from ..core.aten import AtenRecorder, constant_line, is_lifted_constant
from ..core.effects import draws_random, is_inplace_by_name
from ..core.glue import SET_GLOBAL_STATE
from ..core.symbolic import SYMBOLIC_TYPES, SymbolicUnsupported, has_symbols, is_backed
from ..core.symbolic import hint as size_hint
from ..core.symbols import BoundSymbol, TorchSymbol
from ..core.tags import MUTATION, OPAQUE, RANDOM, UNDER_AUTOCAST
from ..errors import CaptureError, user_source
from .module_calls import ModuleCalls
from .state import global_state


class CallsMixin:
    """Recording torch calls as lines of the computation. Part of ``CaptureContext``: it uses
    the context's ``fake_mode`` and ``symbols``, and the inputs part's ``proxy``,
    ``output_proxy`` and ``proxy_of``."""

    def _init_calls(self, module: torch.nn.Module | None) -> None:
        self.bound_symbols: list[BoundSymbol] = []
        self.module_calls = ModuleCalls(module)  # the module calls running: each line's stack
        self.mutated_storages: set[int] = set()
        self.mutated_with_grad: dict[int, bool] = {}
        self.replayed_calls: list = []  # print, logging, warnings.warn: replayed.ReplayedCall
        self.stepped_schedulers: set[int] = set()  # ids of LR schedulers stepped, their optimizers
        self.zeroing_after_step = False  # in an optimizer's zero_grad after them (schedulers.py)
        self.metadata_changed_views: set[int] = set()  # storages of views changed by x.t_(), ...
        self.in_vmap = False
        self.state = self.initial_state = global_state()

    def emit(self, bsym: BoundSymbol) -> None:
        """Record a line of the computation, with the module calls it was made in."""
        bsym.module_stack = self.module_calls.current
        self.bound_symbols.append(bsym)

    def record_global_state(self, final: bool = False) -> None:
        """Record switches of grad mode and autocast the program makes (``with torch.no_grad()``,
        ``with torch.autocast(...)`` inside it), so the computation switches at the same points."""
        state = global_state() if not final else self.initial_state
        if state != self.state:
            changes = tuple((i, v) for i, (v, old) in enumerate(zip(state, self.state)) if v != old)
            self.emit(BoundSymbol(SET_GLOBAL_STATE, (changes,), tags={MUTATION},
                                  source=None if final else user_source()))
            self.state = state

    def record_vmap(self, batched, args, kwargs):
        """Run a ``torch.vmap``-ed function on the fakes, recording the ATen ops its batching
        rules run (functorch's batched tensors never reach the torch function level we record)."""
        self.record_global_state()
        recorder = AtenRecorder()
        self.in_vmap = True
        try:
            with recorder:
                out = batched(*args, **kwargs)
        finally:
            self.in_vmap = False
        source = user_source()

        def arg(x):
            if isinstance(x, torch.Tensor):
                proxy = self.proxy_of.get(id(x))
                if proxy is None:
                    raise CaptureError(f"keraunos: a tensor of unknown origin inside torch.vmap "
                                       f"at {source}; pass it to the vmapped function instead.")
                return proxy
            if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                if self.backed(x):
                    return self.symbols.code(x)
                raise CaptureError(f"keraunos: a size that depends on data inside torch.vmap at "
                                   f"{source}")
            return x
        for call in recorder.calls:
            outputs = pytree.tree_map(
                lambda t: self.output_proxy(t) if isinstance(t, torch.Tensor) else t, call.out)
            if is_lifted_constant(call):
                self.emit(constant_line(call.args[0], outputs, source))
                continue
            call_args, call_kwargs = pytree.tree_map(arg, (call.args, call.kwargs))
            tags = set()
            if call.func._schema.is_mutable:
                tags.add(MUTATION)
                for t in pytree.tree_leaves((call.args, call.kwargs)):
                    if isinstance(t, torch.Tensor):
                        self.mutated_storages.add(t.untyped_storage()._cdata)
                        self.mutated_with_grad.setdefault(t.untyped_storage()._cdata,
                                                          torch.is_grad_enabled())
            self.emit(BoundSymbol(
                TorchSymbol(call.func, f"torch.ops.{call.func}", "function"), tuple(call_args),
                dict(call_kwargs), outputs, source, tags))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                arg(t)  # every result must be a value the trace defines
        return out

    def record_rng(self, name: str, original, args, kwargs):
        symbol = TorchSymbol(original, f"torch.{name}", "function")
        args, kwargs = pytree.tree_map(
            lambda x: self.proxy(x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
        outputs, result = None, None
        if name == "get_rng_state":
            real = original()
            with DisableTorchFunction():  # a stand-in; callers may have no_dispatch() on
                result = torch.empty(real.shape, dtype=real.dtype, device="meta")
                outputs = self.output_proxy(result)
        self.emit(BoundSymbol(symbol, tuple(args), dict(kwargs), outputs,
                              user_source(), {MUTATION, RANDOM}))
        return result

    def backed(self, value) -> bool:
        """Whether a symbolic value is an expression of the input symbols (not of tensor data)."""
        return self.symbols is not None and is_backed(value, self.symbols.bindings)

    def run_opaque(self, func, args, kwargs, for_output: bool = True):
        """Run ``func`` on real zero tensors shaped like the fakes; return fakes of its outputs."""
        from ..torch_internals.fake import unset_fake_temporarily

        def real(x):
            if isinstance(x, torch.Tensor):
                t = torch.empty_strided([size_hint(n) for n in x.shape],
                                        [size_hint(n) for n in x.stride()],
                                        dtype=x.dtype, device=x.device)
                return t.zero_().requires_grad_(x.requires_grad) if x.dtype.is_floating_point \
                    else t.zero_()
            return x
        with unset_fake_temporarily(), DisableTorchFunction():
            real_args, real_kwargs = pytree.tree_map(real, (args, kwargs))
            out = func(*real_args, **real_kwargs)
            if for_output and self.symbols is not None and any(
                    isinstance(x, SYMBOLIC_TYPES) or isinstance(x, torch.Tensor) and
                    has_symbols(x) for x in pytree.tree_leaves((args, kwargs))):
                # Its output's sizes would be those of this call, not symbols.
                raise SymbolicUnsupported(f"{func} has no fake kernel")
            return pytree.tree_map(
                lambda t: self.fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t,
                out)

    def record(self, symbol: TorchSymbol, args, kwargs, out, mutated: list[torch.Tensor],
               opaque: bool = False, under_autocast: bool = False):
        def to_proxy(x):
            if isinstance(x, SYMBOLIC_TYPES):
                return self.symbols.code(x)
            if type(x) is slice and self.symbols is not None:  # x[:, :n]: pytree keeps slices
                return slice(to_proxy(x.start), to_proxy(x.stop), to_proxy(x.step))
            return self.proxy(x) if isinstance(x, torch.Tensor) else x
        p_args, p_kwargs = tree.map_leaves(to_proxy, (args, kwargs))
        outputs = tree.map_leaves(
            lambda x: self.output_proxy(x) if isinstance(x, torch.Tensor) else x, out)
        tags = set()
        if mutated or is_inplace_by_name(symbol):
            tags.add(MUTATION)
            for t in mutated:
                key = t.untyped_storage()._cdata
                self.mutated_storages.add(key)
                # Whether any write happened with grad mode on, to a tensor autograd tracks: the
                # epilogue's copy-back follows (a write through ``.data`` or a detached alias,
                # ``weight.data.clamp_()``, is none: eager records nothing for it).
                self.mutated_with_grad[key] = self.mutated_with_grad.get(key, False) or (
                    torch.is_grad_enabled() and t.requires_grad)
        if draws_random(symbol, args, kwargs):
            tags.add(RANDOM)
        comment = None
        if under_autocast:
            tags.add(UNDER_AUTOCAST)  # autocast cast inside it (capture/recorder.py)
        if opaque:
            tags |= {OPAQUE, MUTATION}  # unknown effects: never removed or merged
            comment = "opaque: no fake kernel; output metadata from a run on zeros"
        self.emit(BoundSymbol(symbol, tuple(p_args), dict(p_kwargs), outputs,
                              user_source(), tags, comment=comment))
