"""Capture a call into its three traces: prologue, computation, epilogue.

``capture_program`` runs the user's program once under the capture context, then:
- the computation: the recorded torch calls as a pure function of the flat inputs. A tensor input
  the program writes to in place is cloned first (or, when several inputs share its memory, the
  whole storage is, and the inputs are rebuilt as views of the clone), so the computation never
  writes to its inputs;
- the epilogue: copies the new values back into the written inputs and buffers, replays module
  attribute writes, and rebuilds the user's return value;
- the prologue: unpacks the flat inputs from ``args``, ``kwargs`` and the module and checks every
  guard.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..torch_internals.fake import LOGGER_NAME as FAKE_LOGGER, FakeTensor, GuardOnDataDependentSymNode
from ..core import glue
from ..core.proxies import NameGenerator, Proxy, TensorProxy
from ..core.symbols import BoundSymbol, Code, TorchSymbol
from ..core.tags import COPY_OF_WRITTEN_INPUT, INPUT_TENSOR
from ..core.trace import Trace

from ..errors import CaptureError, KeraunosError, TorchScriptModuleError, UnguardableStateError
from ..errors import user_source_from_traceback as _innermost_user_source
from .recorder import _data_dependent_error
from .ambient import AmbientSnapshot
from .state import global_state, restore_global_state
from .context import CaptureContext
from .guards import AMBIENT
from .interceptors import intercepting_torch
from .recorder import Recorder
from .symbolic import DynamicRequest
from .state import _active
from ..core.symbolic import (SymbolicUnsupported, expr_key, has_symbols, layout_key,
                             refuse_raw_symbols)

from ..core.templates import Build, FromInput, ObjectRef, ViewGrad, ViewOf
from .epilogue import build_epilogue, template_of
from .dtensor import is_dtensor, program_has_dtensors, rebuild_dtensor
from .dtensor_autograd import region_line
from .leaks import capture_values_in
from .prologue import MutableGroup, build_prologue
from ..core.provenance import root


@dataclass
class Program:
    prologue: Trace
    computation: Trace
    epilogue: Trace
    # Prologue-check index -> words, for explaining cache misses.
    check_descriptions: list[str]
    stages: dict[str, float] = field(default_factory=dict)
    # Objects the compilation needs alive while it runs, and nothing after: the local tensors
    # of DTensors that capture made (a prologue check holds its example tensor weakly).
    keep_alive: list = field(default_factory=list)


def _plain_view(t, ctx) -> bool:
    """Whether a view's layout is known numbers or symbolic sizes of the inputs (not sizes that
    depend on data)."""
    return all(type(v) is int or isinstance(v, torch.SymInt) and ctx.backed(v)
               for v in (*t.shape, *t.stride(), t.storage_offset()))


def _layout(ctx, *values):
    """Sizes, strides and offsets as trace values (symbolic ones as ``s0``-expressions)."""
    if ctx.symbols is None:
        return values
    return tuple(tuple(map(ctx.symbols.code, v)) if isinstance(v, tuple) else ctx.symbols.code(v)
                 for v in values)


def _changed(now, before) -> bool:
    """Whether the program changed a list or dict argument (append, item assignment, ...)."""
    if type(now) is list:
        return len(now) != len(before) or any(a is not b for a, b in zip(now, before))
    return list(now) != list(before) or any(now[k] is not before[k] for k in now)


# Attributes that are the tensor object's own state, not its data.
_TENSOR_STATE = (torch.Tensor.grad, torch.Tensor._base, torch.Tensor.grad_fn)


def _reads_tensor_state(bsym: BoundSymbol) -> bool:
    """``x.grad`` reads the input itself, not its data: it must not move to the working copy."""
    return bsym.symbol is glue.RELEASE_GRAD or isinstance(bsym.symbol, TorchSymbol) and any(
        bsym.symbol.attribute is a for a in _TENSOR_STATE)


# Views whose storage offset is the one the program names, not one relative to what they view.
_ABSOLUTE_OFFSET_VIEWS = (torch.as_strided, torch.Tensor.as_strided, torch.ops.aten.as_strided)


def _view_sources(ctx: CaptureContext) -> dict[str, tuple[TensorProxy, bool]]:
    """For each tensor the program made by viewing an input: the input it views, and whether
    its storage offset is absolute (``as_strided`` somewhere on the way) rather than relative.

    Found by following the recorded ops, not by storage alone: two arguments may be slices of one
    tensor, and a view must be rebuilt from (and send its gradient to) the one it was taken of."""
    source = {e.proxy.name: (e.proxy, False) for e in ctx.inputs}
    for bsym in ctx.bound_symbols:
        viewed = [p for p in bsym.input_proxies() if p.name in source]
        if not viewed:
            continue
        for out in bsym.output_proxies():
            key = ctx.storage_of.get(out.name)
            if out.name in source or key is None:
                continue
            of = next((p for p in viewed if ctx.storage_of[p.name] == key), None)
            if of is not None:
                owner, absolute = source[of.name]
                op = getattr(bsym.symbol, "fn", None)  # torch.as_strided, x.as_strided
                absolute = absolute or any(op is v for v in _ABSOLUTE_OFFSET_VIEWS)
                source[out.name] = (owner, absolute)
    return source


def _view_grad(view, source) -> ViewGrad:
    """How autograd saw ``view`` of ``source`` when the program made it (both fakes)."""
    if not source.requires_grad:
        return ViewGrad.TRACKED  # nothing to detach from
    if not view.requires_grad:
        return ViewGrad.DETACHED
    try:
        grad_fn = view.grad_fn
    except RuntimeError:
        # Autograd refuses to give a grad_fn to a view made under no_grad whose base was
        # written in place since (eager's own returned view raises the same).
        return ViewGrad.NO_GRAD_THEN_WRITTEN
    return ViewGrad.NO_GRAD if grad_fn is None else ViewGrad.TRACKED


def _template_constants(node):
    """The values a return-value template keeps as they were at capture."""
    if isinstance(node, Build):
        children = node.children.values() if isinstance(node.children, dict) else node.children
        for child in children:
            yield from _template_constants(child)
    elif not isinstance(node, (Proxy, FromInput, ViewOf, ObjectRef, Code)):
        yield node


def _refuse_capture_values(template, what: str) -> None:
    for constant in _template_constants(template):
        found = capture_values_in(constant, type(constant).__qualname__)
        if found is not None:
            raise CaptureError(
                f"keraunos cannot capture this program: {what} holds a tensor made during "
                f"capture ({found}, a FakeTensor), which would reach you in place of a real one. "
                f"This happens when the program builds a module or a tensor subclass (a DTensor) "
                f"and returns or stores it.\n  What to do: build such objects outside the jitted "
                f"function and pass them in, or return plain tensors.")


def _refuse_torchscript_modules(module: torch.nn.Module) -> None:
    for name, sub in module.named_modules():
        if isinstance(sub, torch.jit.ScriptModule):
            where = f"module.{name}" if name else "the module"
            raise TorchScriptModuleError(
                f"keraunos cannot capture {where}: it is a TorchScript module "
                f"({type(sub).__name__}, from torch.jit.script or torch.jit.trace), which runs in "
                f"the TorchScript interpreter, not as Python that capture can record.\n"
                f"  What to do: use the module it was made from (keraunos compiles it), or keep "
                f"the default fallback=\"dynamo\", which runs it as it is.")


def capture_program(fn: Callable, module: torch.nn.Module | None, args: tuple, kwargs: dict,
                    check_values: bool = True, specialize_data: bool = False,
                    dynamic: DynamicRequest | None = None) -> Program:
    """The program ``fn`` runs on these arguments, as traces. ``dynamic``: which sizes and ints
    of the call may be symbolic (``symbolic.DynamicRequest``; None: all exact).

    During capture ``torch.compiler.is_compiling()`` is true, so that libraries take the paths
    they keep for compilers. Where such a path fails with the program's own error (transformers'
    LongT5 leaves its attention mask None under a compiler, then reads its shape), the program
    is captured again with it false, as eager runs it; if that fails too, its error is raised."""
    try:
        return _capture(fn, module, args, kwargs, check_values, specialize_data, dynamic, True)
    except KeraunosError:
        raise
    except Exception:  # noqa: BLE001 - the program's own error: tried once more as eager runs
        pass
    return _capture(fn, module, args, kwargs, check_values, specialize_data, dynamic, False)


def _capture(fn, module, args, kwargs, check_values, specialize_data, dynamic,
             as_compiler) -> Program:
    t0 = time.perf_counter()
    if module is not None:
        _refuse_torchscript_modules(module)
    names = NameGenerator()
    ctx = CaptureContext(names, module, fn, dynamic)
    ctx.specialize_data = specialize_data
    ctx.as_compiler = as_compiler
    # A program of DTensors under grad mode is recorded as ATen ops throughout: its backward,
    # recorded through DTensor, may read any value an op makes inside (dtensor_autograd.py).
    ctx.dtensors.record_aten = torch.is_grad_enabled() and program_has_dtensors(module, args, kwargs)
    try:  # taking the inputs in swaps the classes of the objects it watches: restored if it fails
        fake_args = ctx.value_input(args, root("args"), (INPUT_TENSOR,))
        fake_kwargs = ctx.value_input(kwargs, root("kwargs"), (INPUT_TENSOR,))
        ctx.guard_function_scope()
    except BaseException:
        ctx.restore_classes()
        raise
    ctx.guard(AMBIENT, None, AmbientSnapshot.now())  # grad mode, autocast, ...: ambient.py
    state_before = global_state()
    if module is not None:
        ctx.swap_module_classes(module)
    _active.ctx = ctx
    fake_log = logging.getLogger(FAKE_LOGGER)
    log_level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)  # the program's own errors are re-raised, not logged
    try:
        with ctx.fake_mode, Recorder(ctx), intercepting_torch(), \
                ctx.module_calls.recording(ctx):
            out = fn(*fake_args, **fake_kwargs)
        ctx.record_global_state()
    except GuardOnDataDependentSymNode as e:
        raise _data_dependent_error(None, e, _innermost_user_source(e.__traceback__)) from None
    finally:
        fake_log.setLevel(log_level)
        _active.ctx = None
        ctx.restore_classes()
        restore_global_state(state_before)
        changed = ctx.scope_containers.undo_changes()  # globals' lists as before the call
        changed += ctx.undo_scope_writes()  # and the attributes set on objects found by name
    if ctx.unguardable_reads:  # raised where it happened, unless the program caught it
        raise UnguardableStateError(ctx.unguardable_reads[0])
    if changed:
        raise ctx.scope_containers.refuse(changed, ctx.scope_attributes_only_added)
    t1 = time.perf_counter()
    program = _assemble(ctx, out, check_values)
    program.stages["capture"] = t1 - t0
    program.stages["assemble traces"] = time.perf_counter() - t1
    return program


def _assemble(ctx: CaptureContext, out: Any, check_values: bool) -> Program:
    ctx.record_global_state(final=True)  # the program may leave grad mode or autocast switched
    groups, body, renames = _working_copies(ctx)
    body += [b.substitute(renames) if renames and not _reads_tensor_state(b) else b
             for b in ctx.bound_symbols]
    returns = _Returns(ctx, groups, renames)
    out_template, writes, container_writes = _result_templates(ctx, out, returns)
    for g in groups:
        returns.add_output(g.updated)
    params = _computation_inputs(ctx, groups)
    # ``x.grad = None`` frees memory where the computation receives ``x`` itself (not a view of
    # a storage it shares with other inputs, nor under DTensor's autograd): elsewhere only the
    # epilogue's write makes it.
    direct = set() if _dtensor_autograd(ctx) else {p.name for p in params}
    body = [b for b in body if b.symbol is not glue.RELEASE_GRAD or b.args[0].name in direct]
    if _dtensor_autograd(ctx):
        # DTensor's autograd, not the local program's: one line with its own backward.
        body = [region_line(ctx, params, body, returns)]
    # (The return line holds ``returns.flat`` itself: tensors the replayed calls log join it.)
    body.append(glue.RETURN.bind(returns.flat))
    computation = Trace("computation", params, body, ["Constructed by capture"])
    epilogue = build_epilogue(ctx, out_template, returns.flat, groups, writes, container_writes,
                              _replays(ctx, returns))
    prologue, descriptions = build_prologue(ctx, params, groups, epilogue.info_pro_to_epi,
                                            check_values)
    if ctx.symbols is not None and ctx.symbols.bindings:
        for trace in (computation, epilogue.trace):
            refuse_raw_symbols(trace)
    return Program(prologue, computation, epilogue.trace, descriptions,
                   keep_alive=ctx.dtensors.keep_alive)


def _working_copies(ctx: CaptureContext) -> tuple[list[MutableGroup], list[BoundSymbol],
                                                  dict[str, TensorProxy]]:
    """The inputs the program writes in place, grouped by the storage they share with other
    inputs; the lines that copy each group before the program runs; and the renames of the
    inputs that the copy of their own stands for."""
    by_storage: dict[int, list] = {}
    for entry in ctx.inputs:
        by_storage.setdefault(ctx.storage_of[entry.proxy.name], []).append(entry)
    groups: list[MutableGroup] = []
    lines: list[BoundSymbol] = []
    renames: dict[str, TensorProxy] = {}
    for key, members in by_storage.items():
        if key not in ctx.mutated_storages:
            continue
        dense, symbolic = _dense_and_symbolic(ctx, members)
        if dense:
            group, line = _dense_copy(ctx, key, members[0], symbolic)
            renames[group.base.name] = group.updated
            lines.append(line)
        else:
            group, copy_lines = _storage_copy(ctx, key, members)
            lines += copy_lines
        groups.append(group)
    return groups, lines, renames


def _dense_and_symbolic(ctx: CaptureContext, members: list) -> tuple[bool, bool]:
    """Whether a written group is one input that is its whole storage, and whether it has
    symbolic sizes (then it must be dense, and keep its layout)."""
    first = members[0]
    real = first.real
    dense = (len(members) == 1 and real.is_contiguous() and real.storage_offset() == 0
             and real.numel() * real.element_size() == real.untyped_storage().nbytes())
    symbolic = ctx.symbols is not None and any(has_symbols(m.fake) for m in members)
    if symbolic and (not dense or layout_key(first.fake) != (
            *map(expr_key, first.proxy.shape), *map(expr_key, first.proxy.stride))):
        raise SymbolicUnsupported("an input with symbolic sizes that the program writes to "
                                  "shares its memory, or has its shape changed in place")
    return dense, symbolic


def _dense_copy(ctx: CaptureContext, key: int, first, symbolic: bool
                ) -> tuple[MutableGroup, BoundSymbol]:
    """A written input that is its whole storage: the computation works on a clone of it."""
    real = first.real
    base = first.proxy
    clone = TensorProxy(ctx.names.fresh(base.name + "_updated"), first.fake)
    line = BoundSymbol(TorchSymbol(torch.Tensor.clone, "clone", "method"), (base,), {},
                       clone, tags={COPY_OF_WRITTEN_INPUT},
                       comment="written in place: work on a copy")
    final = first.fake
    # The offset as a change: a later call may pass the same layout at another offset.
    # (Compared only when it is numbers: comparing symbols would add guards.)
    meta = (tuple(final.shape), tuple(final.stride()),
            final.storage_offset() - real.storage_offset())
    new_metadata = None
    if not symbolic and meta != (tuple(real.shape), tuple(real.stride()), 0):
        new_metadata = meta + (final.numel() != real.numel(),)
    group = MutableGroup(base, clone, [first], False, ctx.mutated_with_grad[key], new_metadata)
    return group, line


def _storage_copy(ctx: CaptureContext, key: int, members: list
                  ) -> tuple[MutableGroup, list[BoundSymbol]]:
    """Written inputs that share memory (or view part of it): the computation works on a clone
    of the whole storage, and the members are rebuilt as views of the clone."""
    first = members[0]
    real = first.real
    _refuse_mixed_requires_grad(members)
    storage = real.untyped_storage()
    n = storage.nbytes() // real.element_size()
    with ctx.fake_mode:
        flat_fake = torch.empty(n, dtype=real.dtype, device=first.fake.device)
    # The prologue views it through the first member: it requires grad as that did
    # when it was passed (its fake requires grad too once the program wrote a value
    # that does into it, and what the program read before that write does not).
    flat_fake.requires_grad_(first.proxy.requires_grad)
    base = TensorProxy(ctx.names.fresh(first.proxy.name + "_storage"), flat_fake,
                       set(first.proxy.tags), f"storage of {first.path}")
    clone = TensorProxy(ctx.names.fresh(first.proxy.name + "_storage_updated"), flat_fake)
    # The members are views of the copy: passes see them share its memory (a region
    # that made a member from the copy would hand it back as memory of its own, and a
    # later in-place write to it would miss the copy, fuzzer 1000:1857).
    clone._storage = first.fake.untyped_storage()
    clone.storage = clone._storage._cdata
    lines = [BoundSymbol(TorchSymbol(torch.Tensor.clone, "clone", "method"), (base,), {},
                         clone, tags={COPY_OF_WRITTEN_INPUT})]
    for m in members:
        fake = m.fake
        lines.append(BoundSymbol(
            TorchSymbol(torch.Tensor.as_strided, "as_strided", "method"),
            (clone, tuple(fake.shape), tuple(fake.stride()), fake.storage_offset()), {},
            m.proxy))
    for m in members:
        if (tuple(m.fake.shape), tuple(m.fake.stride()), m.fake.storage_offset()) != (
                tuple(m.real.shape), tuple(m.real.stride()), m.real.storage_offset()):
            raise CaptureError(
                f"keraunos: the program changes the shape or strides of {m.path} in place "
                f"(t_(), squeeze_(), resize_()) while other inputs share its memory; "
                f"this is not supported. Use the out-of-place op (t(), squeeze()).")
    return MutableGroup(base, clone, members, True, ctx.mutated_with_grad[key]), lines


def _refuse_mixed_requires_grad(members: list) -> None:
    if torch.is_grad_enabled() and len({m.proxy.requires_grad for m in members}) > 1:
        # One flat copy of the memory cannot be a leaf that requires grad for one member
        # and a detached alias for another: a parameter's gradient was lost when the
        # program wrote its memory through a detached view passed in (fuzzer 21:799).
        # (Under no_grad, the call's mode, no gradient is recorded: one copy serves.)
        paths = ", ".join(f"{m.path} (requires_grad={m.proxy.requires_grad})"
                          for m in members)
        raise CaptureError(
            f"keraunos cannot capture this call: inputs that share memory, {paths}, "
            f"disagree on requires_grad, and the program writes that memory in place.\n"
            f"  What to do: pass a copy (`.clone()`) of the detached tensor, or write "
            f"through the tensor that requires grad under torch.no_grad().")


class _Returns:
    """What the computation returns, found while the return value (and the values written to
    attributes, containers and replayed calls) is turned into templates: the user's tensors (not
    views of written inputs, which the epilogue rebuilds from the inputs themselves), tensors
    written to attributes, the written inputs' new values. ``collect`` is the templates' leaf."""

    def __init__(self, ctx: CaptureContext, groups: list[MutableGroup],
                 renames: dict[str, TensorProxy]):
        self.ctx = ctx
        self.groups = groups
        self.renames = renames
        self.flat: list[TensorProxy] = []
        self.seen: set[str] = set()
        self.mutated_keys = {ctx.storage_of[g.members[0].proxy.name] for g in groups}
        self.members_by_name = {m.proxy.name: g for g in groups for m in g.members}
        self.input_names = {e.proxy.name for e in ctx.inputs}
        self.view_source = _view_sources(ctx)
        self.collected: dict[int, Any] = {}  # id(fake) -> its node: a tensor returned twice is one
        self.dtensor_of: dict[str, Any] = {}  # a returned local tensor's name -> its DTensor
        # A DTensor program with gradients returns what it made, views too: their gradients are
        # DTensor's (see dtensor_autograd.py), not those of views rebuilt outside.
        self.dtensor_autograd = _dtensor_autograd(ctx)
        self.number = ctx.symbols.code if ctx.symbols is not None else None

    def add_output(self, proxy: TensorProxy) -> None:
        if proxy.name not in self.seen:
            self.seen.add(proxy.name)
            self.flat.append(proxy)

    def reference(self, value):
        """An object passed in, put somewhere by the program."""
        if id(value) in self.ctx.argument_objects and not isinstance(value, torch.Tensor):
            return ObjectRef(self.ctx._object_paths[id(value)])
        return None

    def template(self, value):
        """A value the epilogue rebuilds (the return value, a value written to an attribute)."""
        return template_of(value, self.collect, self.ctx.saw_before_the_call,
                           number=self.number, reference=self.reference)

    def logged(self, value):
        """A value a replayed call shows (``print(x.shape)``)."""
        return template_of(value, self.collect, number=self.number)

    def collect(self, tensor):
        ctx = self.ctx
        if is_dtensor(tensor):  # rebuilt around its local tensor: see dtensor.py
            if id(tensor) not in self.collected:
                stand_in = ctx.real_tensor_reached_program(tensor)
                local = self.collect(stand_in._local_tensor)
                if isinstance(local, TensorProxy):  # its gradient comes as this DTensor's
                    self.dtensor_of[local.name] = stand_in
                self.collected[id(tensor)] = Build(rebuild_dtensor, "call", {
                    "local": local, "spec": stand_in._spec})
            return self.collected[id(tensor)]
        if not isinstance(tensor, FakeTensor):  # returned without any op: a global, say
            tensor = ctx.real_tensor_reached_program(tensor)
            self.input_names.add(ctx.proxy(tensor).name)
        if id(tensor) not in self.collected:
            self.collected[id(tensor)] = self._returned(tensor)
        return self.collected[id(tensor)]

    def _returned(self, tensor):
        ctx = self.ctx
        proxy = ctx.proxy(tensor)
        key = ctx.storage_of[proxy.name]
        if key in self.mutated_keys:
            return self._of_written_memory(tensor, proxy, key)
        if proxy.name in self.input_names:  # the input itself: the very object, as in eager
            return FromInput(proxy, proxy, (), (), 0)
        if _plain_view(tensor, ctx) and not self.dtensor_autograd:
            view = self._view(tensor, proxy, key)
            if view is not None:
                return view
        proxy = self.renames.get(proxy.name, proxy)
        self.add_output(proxy)
        return proxy

    def _of_written_memory(self, tensor, proxy, key):
        """A tensor in the memory of a written input: rebuilt from the input after the
        copy-back."""
        ctx = self.ctx
        group = next(g for g in self.groups if ctx.storage_of[g.members[0].proxy.name] == key)
        if proxy.name in self.members_by_name:
            return FromInput(proxy, group.base, (), (), 0)
        if tensor.requires_grad and not tensor._is_view():
            # An alias autograd does not track as a view (x.detach(), x.data) that the
            # program then wrote with a value requiring grad: in eager its history is its
            # own (the write), which a view rebuilt from the input cannot have.
            raise CaptureError(
                f"keraunos cannot capture this program: it returns {proxy.name}, an alias of "
                f"an input's memory made outside autograd (.detach(), .data) and then written "
                f"in place with a value that requires grad; its gradient would differ from "
                f"eager's.\n  What to do: return a copy (.clone()) of it, or write to a "
                f"tensor of its own.")
        # The view is rebuilt after the copy-back, from the input (or its whole storage).
        owner, absolute = self.view_source.get(proxy.name, (group.members[0].proxy, False))
        base_offset = 0 if group.whole_storage else group.members[0].fake.storage_offset()
        return FromInput(None, group.base, *_layout(
            ctx, tuple(tensor.shape), tuple(tensor.stride()),
            tensor.storage_offset() - (0 if absolute else base_offset)),
            _view_grad(tensor, ctx.fake_of[owner.name]), absolute)

    def _view(self, tensor, proxy, key):
        """A view is returned as a view of what it views: of the input itself (so that
        writing to it writes to the input, as in eager), or of a returned intermediate."""
        ctx = self.ctx
        owner, absolute = self.view_source.get(proxy.name, (None, False))
        if owner is not None and owner.dtype == tensor.dtype:
            source = ctx.fake_of[owner.name]
            return FromInput(None, owner, *_layout(
                ctx, tuple(tensor.shape), tuple(tensor.stride()),
                tensor.storage_offset() - (0 if absolute else source.storage_offset())),
                _view_grad(tensor, source), absolute)
        base = tensor._base
        if base is not None and id(base) in ctx.proxy_of and base.dtype == tensor.dtype and \
                ctx.storage_of[ctx.proxy_of[id(base)].name] == key:
            return ViewOf(self.collect(base), *_layout(
                ctx, tuple(tensor.shape), tuple(tensor.stride()),
                tensor.storage_offset() - base.storage_offset()), _view_grad(tensor, base))
        return None


def _dtensor_autograd(ctx: CaptureContext) -> bool:
    """Whether DTensor's autograd ran in the program (so its backward is capture's to record)."""
    return ctx.dtensors.autograd and torch.is_grad_enabled()


def _result_templates(ctx: CaptureContext, out: Any, returns: _Returns):
    """The templates the epilogue rebuilds: the return value, the values written to module
    attributes, and the lists and dicts of the arguments the program changed."""
    out_template = returns.template(out)
    # Objects the program made (a cache layer it appended) are made again on every call.
    writes = [(w, returns.template(w.value)) for w in ctx.attribute_writes]
    container_writes = [(path, returns.template(list(now) if type(now) is list else dict(now)))
                        for path, now, before in ctx.containers if _changed(now, before)]
    _refuse_capture_values(out_template, "the return value")
    for w, template in writes:
        _refuse_capture_values(template, f"the value written to {w.module_path}.{w.name}")
    for path, template in container_writes:
        _refuse_capture_values(template, f"what the program put into {path}")
    return out_template, writes, container_writes


def _computation_inputs(ctx: CaptureContext, groups: list[MutableGroup]) -> list[TensorProxy]:
    """The computation's parameters: each input, or the storage its written group copies, then
    the sizes the prologue reads (``s0``, ``s1``, ...)."""
    mutable_members = {m.proxy.name for g in groups for m in g.members}
    params: list[TensorProxy] = []
    for entry in ctx.inputs:
        if entry.proxy.name in mutable_members:
            g = next(g for g in groups if entry in g.members)
            if g.base not in params:
                params.append(g.base)
        else:
            params.append(entry.proxy)
    if ctx.symbols is not None:
        params += ctx.symbols.proxies
    return params


def _replays(ctx: CaptureContext, returns: _Returns) -> list[tuple]:
    """The ``print`` and logging calls the epilogue replays, with the values they show."""
    replays = []
    for call in ctx.replayed_calls:
        replay, values = call.replay()
        source = call.source
        where = f"{source.filename}:{source.lineno}: {source.code}" if source else call.label
        replays.append((replay, [returns.collect(v) if isinstance(v, torch.Tensor) else v
                                 if isinstance(v, ObjectRef) else returns.logged(v)
                                 for v in values],
                        call.label, where))
    return replays
