"""What a fusion line of a trace calls: a region's kernel, with the layouts of its inputs and
outputs checked on the first call and fixed where they differ from the ones it was compiled for
(``RegionCall``).

The first call makes the kernel ready (g++ may still be building it: ``Kernel.ready``), runs it
once with every input and output compared with the trace's layouts, and then picks what later
calls run: the kernel past Inductor's wrappers (``Kernel.direct``) where nothing differed, or a
call that lays out again the inputs and outputs that did. A kernel g++ could not build, or an
input to be laid out again that the region writes, leaves the region's own lines to run on the
torch executor.
"""
from __future__ import annotations

import torch

from ...core.proxies import TensorProxy
from . import float_symbols, symbolic
from .compiler import Kernel, SymbolicUnguardable, emptied, warn_once


class RegionCall:
    """What a fusion line calls: the region's kernel, with strides checked on the first call.

    Inputs the caller passes in (gradients, in the backward) can come with any strides on any
    call; ``always_checked`` names their positions. Other inputs and the outputs are checked once:
    layouts follow from the input metadata, which the prologue checks. With symbolic sizes the
    traced layouts are expressions, evaluated with the sizes of the call (``symbolic.Layout``).

    Inductor hands back one buffer for outputs it found equal (``return t.clone(), t.clone()``:
    the same tensor twice); an output whose memory the trace says is its own, but which came
    back sharing another output's, is copied on every call (``copied_outputs``,
    found on the first call: the graph's buffers are planned once)."""

    def __init__(self, kernel: Kernel, inputs: list[TensorProxy], outputs: list[TensorProxy],
                 always_checked: tuple[int, ...], fallback=None, make_fallback=None,
                 layout: symbolic.Layout | None = None, written: tuple[int, ...] = (),
                 writes: bool = False):
        self.kernel = kernel
        # Float symbols (a learning rate): the kernel takes them as 0-dim float64 tensors, the
        # region's own lines as the floats they are (``float_symbols``).
        self.floats = float_symbols.positions(inputs)
        if self.floats:
            fallback = _taking_floats(fallback, self.floats)
            make_fallback = make_fallback and (
                lambda made=make_fallback: _taking_floats(made(), self.floats))
        self.written = written  # inputs whose memory the region writes: never copied
        self.writes = writes or bool(written)  # the region writes in place (through any view)
        self.make_fallback = make_fallback  # the region's own lines, should g++ have failed
        self.inputs = [(p.shape, p.stride) if isinstance(p, TensorProxy) else None
                       for p in inputs]  # None: a size symbol, passed as an int
        self.outputs = [(p.shape, p.stride) for p in outputs]
        self.storages = ([p.storage if isinstance(p, TensorProxy) else None for p in inputs],
                         [p.storage for p in outputs])  # the memory sharing the trace says
        self.copied_outputs: tuple[int, ...] = ()
        metas = [m for m in self.inputs + self.outputs if m is not None]
        self.layout = ((layout or symbolic.Layout(inputs)) if any(map(symbolic.is_symbolic, (
            v for shape, stride in metas for v in (*shape, *stride)))) else None)
        self.always_checked = always_checked
        # No input requires grad (checked before every call: by the prologue, or by Dynamo's
        # guards on the backend route), so no output does, in grad mode or not.
        self.grad_free = not any(isinstance(p, TensorProxy) and p.requires_grad for p in inputs)
        self.fixed_outputs: tuple[int, ...] = ()
        self.run = self._first_call
        self._evaluators = None  # with symbolic sizes: each layout as a function of the sizes
        self.guard = self.guard_source = None
        self.fallback = fallback  # the region's own lines, where a guard fails
        if kernel.guards:
            made = symbolic.guard_function(kernel.guards, self.layout)
            if made is None:
                raise SymbolicUnguardable(kernel.guards)
            self.guard, _ = made
            env = symbolic.shape_env_of(v for m in metas for v in (*m[0], *m[1]))
            self.guard_source = symbolic.readable(kernel.guards,
                                                  getattr(env, "keraunos_names", None) or {})

    def __call__(self, *args):
        if self.floats:
            args = float_symbols.as_stand_ins(args, self.floats)
        if self.layout is None:
            return self.run(*args)
        if self.guard is not None and not self.guard(*self.layout.values(args)):
            return self.fallback(*args)
        return self.run(*args, *self.layout.extra_values(args))

    def take(self, args: list):
        """The call, with the inputs handed over in ``args``, a list the kernel empties, so that
        it frees each input at its last use (``glue.HandOver``). Where the kernel cannot take
        them so (the first call, layouts fixed, symbolic sizes), the list is emptied here and
        the call made as any."""
        take = getattr(self.run, "take", None) if self.layout is None else None
        if take is not None:
            for k in self.floats:
                args[k] = float_symbols.stand_in(args[k])
            return take(args)
        return self(*emptied(args))

    def _metas(self, args):
        """The input and output layouts of this call: the traced ones, evaluated when symbolic."""
        if self.layout is None:
            return self.inputs, self.outputs
        if self._evaluators is None:
            self._evaluators = [None if m is None else self.layout.evaluator((*m[0], *m[1]))
                                for m in self.inputs + self.outputs]
        values = self.layout.values(args)
        metas = []
        for meta, evaluate in zip(self.inputs + self.outputs, self._evaluators):
            if evaluate is None:  # a size symbol, or a size the call does not give
                metas.append(None)
                continue
            both = evaluate(*values)
            metas.append((both[:len(meta[0])], both[len(meta[0]):]))
        return metas[:len(self.inputs)], metas[len(self.inputs):]

    def _first_call(self, *args):
        try:
            self.kernel.ready()
        except Exception as e:  # noqa: BLE001 - a kernel g++ could not build: the lines run
            if self.make_fallback is None:
                raise
            warn_once(f"keraunos: Inductor could not build the kernels of "
                      f"{self.kernel.first_region} ({type(e).__name__}: {e}); its lines run "
                      f"on the torch executor.")
            lines, count = self.make_fallback(), len(self.inputs)
            self.run = lambda *a: lines(*a[:count])  # (symbolic sizes: without the extras)
            return self.run(*args)
        inputs, outputs = self._metas(args)  # (with symbolic sizes, args end with the extras)
        inputs = inputs + [None] * (len(args) - len(inputs))
        fix_inputs = tuple(i for i, m in enumerate(inputs)
                           if m is not None and args[i].stride() != m[1])
        if set(fix_inputs) & set(self.written):  # a copy would take the write: the lines run
            lines, count = self.make_fallback(), len(self.inputs)
            self.run = lambda *a: lines(*a[:count])
            return self.run(*args)
        checked = tuple(sorted(set(self.always_checked) | set(fix_inputs)))
        self.always_checked = checked
        given = _restrided(args, checked, inputs)
        before = self.kernel.inputs_it_writes(given)
        outs = self.kernel.fn(*given)
        self.fixed_outputs = tuple(i for i, t in enumerate(outs)
                                   if outputs[i] is not None and t.stride() != outputs[i][1])
        self.copied_outputs = _shared_unlike_the_trace(
            given, outs, *self.storages, range(len(given)) if self.writes else ())
        self.kernel_fn = self.kernel.direct(given, outs, self.grad_free, before)
        del before
        self.run = self.kernel_fn if not (checked or self.fixed_outputs or self.copied_outputs) \
            else self._fixing_call
        return self._finished(outs, outputs)

    def _fixing_call(self, *args):
        inputs, outputs = self._metas(args)
        inputs = inputs + [None] * (len(args) - len(inputs))
        outs = self.kernel_fn(*_restrided(args, self.always_checked, inputs))
        return self._finished(outs, outputs)

    def _finished(self, outs, outputs):
        outs = _restrided(outs, self.fixed_outputs, outputs)
        if self.copied_outputs:
            outs = list(outs)
            for i in self.copied_outputs:
                outs[i] = outs[i].clone()
        return outs


def _taking_floats(lines, floats: tuple[int, ...]):
    """The region's own lines, called with the kernel's arguments (float symbols as tensors)."""
    if lines is None:
        return None
    return lambda *args: lines(*float_symbols.as_floats(args, floats))


def _shared_unlike_the_trace(args, outs, input_storages, output_storages,
                             written=()) -> tuple[int, ...]:
    """Positions of outputs that share memory with an earlier output or with an input the region
    writes, where the trace's storages (``TensorProxy.storage``; None: unknown, its own) say
    they do not: Inductor returns one buffer for equal outputs, and may return a written input's
    buffer for its clone (fuzzer with fusion, 91:144 and 94:81). An output sharing the memory of
    an input the region does not write is a view AOTAutograd's wrapper remade on purpose:
    copying it would lose a later write through it (94:11)."""
    owner: dict[int, object] = {}  # the call's memory -> the trace's storage first seen in it
    for k in written:
        if k < len(args) and isinstance(args[k], torch.Tensor):
            owner.setdefault(args[k].untyped_storage()._cdata, input_storages[k])
    copied = []
    for i, (t, storage) in enumerate(zip(outs, output_storages)):
        if not isinstance(t, torch.Tensor):
            continue
        key = t.untyped_storage()._cdata
        if key in owner and (storage is None or owner[key] != storage):
            copied.append(i)
        else:
            owner.setdefault(key, storage)
    return tuple(copied)


def _restrided(tensors, positions, metas) -> list:
    """``tensors`` with those at ``positions`` given the recorded strides (a copy only when the
    element order differs; dims of size 0 or 1 take any stride without moving memory)."""
    if not positions:
        return tensors
    tensors = list(tensors)
    for i in positions:
        if metas[i] is None:  # a size symbol, or a layout with a size the call does not give
            continue
        t, (shape, stride) = tensors[i], metas[i]
        if t.stride() == stride:
            continue
        if all(a == b or n <= 1 for a, b, n in zip(t.stride(), stride, shape)):
            tensors[i] = torch.empty((0,), dtype=t.dtype, device=t.device).set_(
                t.untyped_storage(), t.storage_offset(), shape, stride)
        else:
            tensors[i] = _relaid(t, shape, stride)
    return tensors


def _relaid(t: torch.Tensor, shape, stride) -> torch.Tensor:
    """A copy of ``t`` laid out as ``(shape, stride)``. A layout that repeats memory (stride 0
    over a size above 1) is an expanded tensor: the trace made the value by ``expand``, so it
    is the same along that dim whatever the call's strides (a gradient of ``out.sum()`` comes
    expanded along every dim); one slice of ``t`` is copied and expanded again."""
    repeated = [d for d, (n, s) in enumerate(zip(shape, stride)) if s == 0 and n > 1]
    source = t
    for d in repeated:
        source = source.narrow(d, 0, 1)
    out = torch.empty_strided(source.shape, stride, dtype=t.dtype, device=t.device).copy_(source)
    return out.expand(shape) if repeated else out
