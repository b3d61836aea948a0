"""The glue vocabulary: every line of a trace that is ours rather than the user's.

A trace's user operations are ``TorchSymbol`` lines. Around them, capture and the passes write
lines of their own: unpacking inputs, checking guards, copying results back, returning. Each kind
is one ``Glue`` symbol defined here, once. A glue line is a ``BoundSymbol`` whose ``symbol`` is one
of them (compare by identity: ``b.symbol is glue.CHECK_TENSOR``), whose ``args`` hold the proxies
it reads (so def-use is visible to every pass and to the checker), and whose ``fields`` hold the
rest as one typed record (``glue.Unpack(path=...)``); ``symbol.bind(...)`` makes one.

In the **prologue** (``def prologue(*args, **kwargs)``):

=======================  ===========================  ==============================================
symbol                   args (what it reads)         fields, and what the line does
=======================  ===========================  ==============================================
UNPACK                   the parent object            ``Unpack``: ``x = parent.<path>``
UNPACK_CONSTANT          --                           ``UnpackConstant``: a captured tensor by name
STORAGE_VIEW             a tensor                     ``StorageView``: a flat view of its storage
CHECK                    the variables it reads       ``Check``: ``if <condition>: return <index>``
CHECK_ALIAS              two inputs                   ``CheckAlias``: the same object as compiled
CHECK_TENSOR             a tensor                     ``CheckTensor``: shape, stride, dtype, ...
CHECK_SYMBOLIC_TENSOR    a tensor                     ``CheckSymbolicTensor``: sizes as expressions
BIND_SYMBOL              the tensor holding the size  ``BindSymbol``: ``s0 = x.shape[1]``
CHECK_SIZES              the size symbols             ``CheckSizes``: the guards on the symbols
PYTHON                   --                           ``Python``: lines a pass writes (fast prologue)
RETURN_INPUTS            inputs, values for epilogue  ``return (inputs), (pro_to_epi)``
=======================  ===========================  ==============================================

In the **computation**, the **backward** and fused **regions**:

=======================  ===========================  ==============================================
SET_GLOBAL_STATE         --                           ``SetGlobalState``: grad mode, autocast
ALIAS                    the input written in place   ``x_updated = x`` (reinplace: no copy)
SIZE                     a tensor                     ``Size``: a size the backward needs
DELETE                   the proxies freed            ``del a, b``
FusionCall (a class)     the region's inputs          one compiled region's call, lines as comments
RETURN                   the outputs                  the computation returns its flat outputs
RETURN_FORWARD           outputs, saved tensors       the forward returns what backward needs too
RETURN_GRADIENTS         the gradients                the backward returns one per input
RETURN_REGION            the region's outputs         a region's own trace returns
=======================  ===========================  ==============================================

In the **epilogue** (``def epilogue(outputs, pro_to_epi)``):

=======================  ===========================  ==============================================
UNPACK_OUTPUTS           --                           ``UnpackOutputs``: names for what came in
COPY_BACK                the input, its new value     ``CopyBack``: ``x.copy_(x_updated)``
MAKE_VIEW                a view node                  a returned view, rebuilt per call
WRITE_ATTRIBUTE          object, value template       ``WriteAttribute``: ``module.name = value``
WRITE_CONTAINER          list or dict, template       the program's changes to a list or dict
REPLAY_CALL              the tensors it shows         ``ReplayCall``: a print, log or warning, again
RETURN_VALUE             the return-value template    the user's structure, rebuilt
=======================  ===========================  ==============================================

Templates (``core/templates.py``) are the epilogue's return values and attribute values with
proxies inside; the lines that take them read those proxies, which ``pro_to_epi`` hands over.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..torch_internals.autograd import SET_GRAD_ENABLED_SOURCE
from .symbols import BoundSymbol, CodeWriter, Symbol
from .templates import ViewGrad, template_code


class Glue(Symbol):
    """A glue operation. ``fields``: the record type its lines carry (``None``: no fields);
    ``formatter(bsym, w)`` returns its Python lines; ``runtime`` holds objects those lines call,
    added to the trace's namespace under their own names."""

    def __init__(self, name: str, formatter: Callable[[BoundSymbol, CodeWriter], list[str]],
                 fields: type | None = None, runtime: dict[str, Any] | None = None):
        self.name = name
        self.formatter = formatter
        self.fields = fields
        self.runtime = runtime or {}

    def bind(self, *args, outputs=None, tags=(), source=None, executor=None,
             **fields) -> BoundSymbol:
        """A line of this symbol: ``args`` are what it reads, keywords its fields."""
        record = self.fields(**fields) if self.fields is not None else None
        if record is None and fields:
            raise TypeError(f"glue {self.name} has no fields; got {sorted(fields)}")
        return BoundSymbol(self, tuple(args), outputs=outputs, tags=set(tags), source=source,
                           executor=executor, fields=record)

    def format(self, bsym, w):
        w.namespace.update(self.runtime)
        return self.formatter(bsym, w)


def is_glue(bsym: BoundSymbol) -> bool:
    return isinstance(bsym.symbol, Glue)


# --- the prologue ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Unpack:
    path: Any  # a capture.provenance.Path: how the value is reached from its parent

    @property
    def subject(self):
        return self.path


def _unpack(bsym, w):
    (parent,) = bsym.args
    return [f"{bsym.outputs.name} = {bsym.fields.path.expression(parent.name)}"]


@dataclass(frozen=True)
class UnpackConstant:
    path: Any
    constant: str  # the namespace name holding the tensor the program refers to


@dataclass(frozen=True)
class StorageView:
    numel: int


def storage_view(t: torch.Tensor, numel: int) -> torch.Tensor:
    """A flat view of all of ``t``'s storage. Taken of the tensor ``t`` views (when it views one
    with its dtype and requires_grad) so that gradients reach memory outside ``t`` itself (the
    rows of another argument sharing the storage), as they do in eager."""
    base = t._base
    if base is None or base.dtype is not t.dtype or base.requires_grad is not t.requires_grad:
        base = t
    return torch.as_strided(base, (numel,), (1,), 0)


@dataclass(frozen=True)
class Check:
    condition: Callable[[CodeWriter], str]  # the Python condition under which the check fails
    index: int                              # what the prologue returns when it fails
    description: str
    guard: Any = None                       # the capture.guards.Guard it checks, if one
    subject: Any = None                     # the Path of the value it is about, if one
    tensor_guards: Any = None               # the TensorGuards its condition calls, if one


def _check(bsym, w):
    f = bsym.fields
    return [f"if {f.condition(w)}: return {f.index}  # {f.description}"]


@dataclass(frozen=True)
class CheckAlias:
    index: int
    description: str
    paths: tuple  # the two Paths: this input, and the one it must be

    @property
    def subject(self):
        return self.paths[0]


def _check_alias(bsym, w):
    this, first = bsym.args
    return [f"if {this.name} is not {first.name}: return {bsym.fields.index}  "
            f"# {bsym.fields.description}"]


@dataclass(frozen=True)
class TensorMetadata:
    """What a tensor check compares: sizes and strides (numbers, or expressions of the symbols
    for a symbolic check), dtype, device, requires_grad."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


@dataclass(frozen=True)
class CheckTensor:
    expected: TensorMetadata
    index: int
    path: str
    real: weakref.ref  # the compiling call's tensor (held weakly), an example for C++ guards


def check_tensor(t, shape, stride, dtype, device, requires_grad) -> bool:
    """The metadata check of one tensor, as the readable prologue writes it."""
    return (isinstance(t, torch.Tensor) and t.shape == shape and t.stride() == stride
            and t.dtype is dtype and t.device == device and t.requires_grad is requires_grad)


def _check_tensor(bsym, w):
    (t,), e = bsym.args, bsym.fields.expected
    return [f"if not check_tensor({t.name}, {w.value(e.shape)}, {w.value(e.stride)}, "
            f"{w.value(e.dtype)}, {w.value(e.device)}, {e.requires_grad}): "
            f"return {bsym.fields.index}"]


@dataclass(frozen=True)
class CheckSymbolicTensor:
    expected: TensorMetadata
    index: int
    bound_dims: frozenset  # dimensions read into their own symbols (s0 = x.shape[0])


def _check_symbolic_tensor(bsym, w):
    # The rest was checked in one C++ call (a CHECK over dynamo's TensorGuards): here only the
    # sizes and strides that are expressions of the symbols, leaving out the dimensions read
    # into their own symbols.
    (t,), f = bsym.args, bsym.fields
    parts = [f"{t.name}.shape[{d}] == {w.value(size)}" for d, size in enumerate(f.expected.shape)
             if d not in f.bound_dims and not isinstance(size, int)]
    if not all(isinstance(stride, int) for stride in f.expected.stride):  # one call, not two
        parts.append(f"{t.name}.stride() == {w.value(f.expected.stride)}")
    if not parts:
        return [f"pass  # {t.name}: its sizes are its symbols, its strides numbers"]
    return [f"if not ({' and '.join(parts)}): return {f.index}"]


@dataclass(frozen=True)
class BindSymbol:
    read: str   # the expression reading the size (``x.shape[1]``)
    where: str  # where it comes from, in the user's words


def _bind_symbol(bsym, w):
    return [f"{bsym.outputs.name} = {bsym.fields.read}  # {bsym.fields.where}"]


@dataclass(frozen=True)
class CheckSizes:
    symbols: Any  # the capture's symbolic sizes (capture.symbolic.Symbols): its guards


def _check_sizes(bsym, w):
    # Read from the ShapeEnv now, when the prologue is generated: after the capture, the
    # backward's recording on the same symbols may have added guards.
    lines = []
    for condition, why in bsym.fields.symbols.checks():
        text = f"{condition} ({why})" if why else condition
        lines.append(f"if not ({condition}): return {text!r}")
    return lines or ["pass  # no guards on the symbolic sizes"]


@dataclass(frozen=True)
class Python:
    """Lines a pass writes as Python (the fast prologue's cached walk and batched checks)."""

    label: str
    lines: Callable[[CodeWriter], list[str]]  # the line's outputs are the proxies they bind


def _return_inputs(bsym, w):
    inputs, pro_to_epi = bsym.args
    return [f"return {w.value(tuple(inputs))}, {w.value(tuple(pro_to_epi))}"]


UNPACK = Glue("unpack", _unpack, Unpack)
UNPACK_CONSTANT = Glue("unpack_constant",
                       lambda b, w: [f"{b.outputs.name} = {b.fields.constant}"], UnpackConstant)
STORAGE_VIEW = Glue("storage_view", lambda b, w: [
    f"{b.outputs.name} = storage_view({b.args[0].name}, {b.fields.numel})"], StorageView,
    {"storage_view": storage_view})
CHECK = Glue("check", _check, Check)
CHECK_ALIAS = Glue("check_alias", _check_alias, CheckAlias)
CHECK_TENSOR = Glue("check_tensor", _check_tensor, CheckTensor, {"check_tensor": check_tensor})
CHECK_SYMBOLIC_TENSOR = Glue("check_symbolic_tensor", _check_symbolic_tensor, CheckSymbolicTensor)
BIND_SYMBOL = Glue("bind_symbol", _bind_symbol, BindSymbol)
CHECK_SIZES = Glue("check_sizes", _check_sizes, CheckSizes)
PYTHON = Glue("python", lambda b, w: b.fields.lines(w), Python)
RETURN_INPUTS = Glue("return_inputs", _return_inputs)


# --- the computation, the backward, fused regions --------------------------------------------

# The layout of ``capture.state.global_state()``: grad mode, then (enabled, dtype) of autocast
# for each of these device types.
AUTOCAST_DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def _set_global_state(bsym, w):
    lines = []
    for i, value in bsym.args[0]:
        if i == 0:
            lines.append(f"{SET_GRAD_ENABLED_SOURCE}({value!r})")
        else:
            device = AUTOCAST_DEVICES[(i - 1) // 2]
            if (i - 1) % 2 == 0:
                lines.append(f"torch.set_autocast_enabled({device!r}, {value!r})")
            else:
                lines.append(f"torch.set_autocast_dtype({device!r}, {w.value(value)})")
    return lines


def _alias(bsym, w):
    return [f"{bsym.outputs.name} = {bsym.args[0].name}  # written in place, directly: "
            f"nothing here records autograd"]


def _size(bsym, w):
    tensor, dim = bsym.args
    return [f"{bsym.outputs.name} = {tensor.name}.size({dim})  # a size the backward needs"]


def _return(bsym, w):
    outputs = bsym.args[0]
    if len(outputs) == 1:
        return [f"return {w.value(outputs[0])},"]
    return [f"return {w.value(tuple(outputs))}"]


def _return_forward(bsym, w):
    outputs, saved = bsym.args
    return [f"return {w.value(tuple(outputs))}, {w.value(tuple(saved))}"]


SET_GLOBAL_STATE = Glue("set_global_state", _set_global_state)  # args: ((index, value), ...)
ALIAS = Glue("alias", _alias)
SIZE = Glue("size", _size)
DELETE = Glue("del", lambda b, w: [f"del {', '.join(p.name for p in b.args)}"])
RETURN = Glue("return", _return)
RETURN_FORWARD = Glue("return_forward", _return_forward)
RETURN_GRADIENTS = Glue("return_gradients",
                        lambda b, w: [f"return {w.value(tuple(b.args[0]))}"])
RETURN_REGION = Glue("return_region",
                     lambda b, w: [f"return {', '.join(p.name for p in b.args)},"])

# Every line that ends a trace by returning from it.
RETURNS = frozenset({RETURN_INPUTS, RETURN, RETURN_FORWARD, RETURN_GRADIENTS, RETURN_REGION})


class FusionCall(Symbol):
    """One fused region as one line: the call of its compiled kernel (named after the region,
    in the trace's namespace), with the region's own lines printed as comments below a header
    saying which layer it is and whose kernel it runs. Each region is its own symbol.

    ``region``: a fusion executor's region (``executors.FusionExecutor`` says what it has;
    ``executors.fusion.FusionRegion`` is Inductor's); ``call``: the callable that runs it."""

    def __init__(self, region, call):
        self.name = region.name
        self.region = region
        self.call = call

    def format(self, bsym, w):
        w.namespace[self.name] = self.call
        r = self.region
        where = f"layer {r.layer}, " if r.layer else ""
        writes = f", writes {', '.join(r.written)} in place" if r.written else ""
        lines = [f"# {self.name}: {where}{len(r.lines)} lines{writes}, {r.describe_kernel()}"]
        if getattr(self.call, "guard_source", None):  # sizes assumed: others run the lines below
            lines.append(f"#   kernel where {self.call.guard_source}; else these lines:")
        sub = CodeWriter({})  # comments only: nothing may enter the trace's namespace
        sub.defined = set(w.defined)
        for b in r.lines:
            lines += [f"#   {line}" for line in b.symbol.format(b, sub)]
            sub.defined.update(p.name for p in b.output_proxies())
        args = ", ".join(p.name for p in bsym.args)
        if isinstance(bsym.fields, HandOver):  # inputs that die here: the kernel frees them
            handed = f"{self.name}_inputs"
            return lines + [f"{handed} = [{args}]", f"del {', '.join(bsym.fields.names)}",
                            w.assignment(bsym, f"{self.name}.take({handed})")]
        return lines + [w.assignment(bsym, f"{self.name}({args})")]


@dataclass(frozen=True)
class HandOver:
    """A fused region's line whose inputs ``names`` are used last there (``passes/deletion.py``):
    they are handed to the kernel in a list it empties, and deleted before the call, so that
    the kernel frees each at its own last use (a backward's saved activations, as eager's
    backward frees them) instead of all of them when it returns. A region's call that can take
    its inputs so has ``take(list)``."""

    names: tuple[str, ...]


# --- the epilogue -----------------------------------------------------------------------------

@dataclass(frozen=True)
class UnpackOutputs:
    origin: str  # "outputs" (the computation's) or "pro_to_epi" (the prologue's)


def _unpack_outputs(bsym, w):
    names = [p.name for p in bsym.outputs]
    if not names:
        return []
    return [f"{', '.join(names)}{',' if len(names) == 1 else ''} = {bsym.fields.origin}"]


@dataclass(frozen=True)
class CopyBack:
    with_grad: bool = True  # whether the program wrote with grad mode on
    # (shape, stride, offset change, resized) when the program changed the input's metadata in
    # place (t_(), squeeze_(), resize_()): the input gets its new metadata first.
    new_metadata: tuple | None = None


def _copy_back(bsym, w):
    target, value = bsym.args
    copy = f"{target.name}.copy_({value.name})"
    meta = bsym.fields.new_metadata
    if meta is not None:
        shape, stride, offset_change, resized = meta
        prefix = f"{target.name}.resize_({shape}); " if resized else ""
        offset = f"{target.name}.storage_offset()" + (f" + {offset_change}" if offset_change else "")
        copy = f"{prefix}{target.name}.as_strided_({shape}, {stride}, {offset}); {copy}"
    if not bsym.fields.with_grad:
        return [f"with torch.no_grad(): {copy}  # written in place by the program, under no_grad"]
    return [f"{copy}  # written in place by the program"]


def _make_view(bsym, w):
    node = bsym.args[0]
    base = template_code(node.base, w)
    source = f"{base}.detach()" if node.grad is ViewGrad.DETACHED else base
    if getattr(node, "absolute", False):
        offset = str(node.offset)
    elif isinstance(node.offset, int):
        offset = f"{base}.storage_offset()" + (f" + {node.offset}" if node.offset else "")
    else:  # a size expression
        offset = f"{base}.storage_offset() + ({node.offset})"
    line = (f"{node.name} = {source}.as_strided({w.value(node.size)}, {w.value(node.stride)}, "
            f"{offset})")
    if node.grad is ViewGrad.NO_GRAD_THEN_WRITTEN:
        return [f"with torch.no_grad(): {line}  # the program made this view under no_grad",
                f"torch.autograd.graph.increment_version({base})  # ... then wrote {base}"]
    if node.grad is ViewGrad.NO_GRAD:
        return [f"with torch.no_grad(): {line}  # the program made this view under no_grad"]
    return [line]


@dataclass(frozen=True)
class WriteAttribute:
    name: str


def _write_attribute(bsym, w):
    obj, value = bsym.args
    code, name = template_code(value, w), bsym.fields.name
    if name.isidentifier():
        return [f"{obj.name}.{name} = {code}"]
    return [f"setattr({obj.name}, {name!r}, {code})"]


def _write_container(bsym, w):
    container, template = bsym.args
    if getattr(template, "kind", None) == "list":
        return [f"{container.name}[:] = {template_code(template, w)}  "
                f"# the program changed this list"]
    return [f"{container.name}.clear()",
            f"{container.name}.update({template_code(template, w)})  "
            f"# the program changed this dict"]


UNPACK_OUTPUTS = Glue("unpack_outputs", _unpack_outputs, UnpackOutputs)
COPY_BACK = Glue("copy_back", _copy_back, CopyBack)
MAKE_VIEW = Glue("make_view", _make_view)
WRITE_ATTRIBUTE = Glue("write_attribute", _write_attribute, WriteAttribute)
WRITE_CONTAINER = Glue("write_container", _write_container)


def _release_grad(bsym, w):
    return [f"{bsym.args[0].name}.grad = None  # where the program sets it, as eager frees it "
            f"there; the epilogue writes what the program leaves"]


# ``x.grad = None`` (``zero_grad(set_to_none=True)``) of an input, in the computation where the
# program makes it: the old gradient's memory is free from there on, as in eager. It writes no
# tensor's memory (no MUTATION tag: passes may move writes and reads of ``x`` across it), and
# as a glue line without outputs no pass drops it.
RELEASE_GRAD = Glue("release_grad", _release_grad)
@dataclass(frozen=True)
class ReplayCall:
    """A ``print``/logging/``warnings.warn`` call of the program (``replay``, a callable that
    takes the tensors it shows), made again on every call; ``description`` is the line."""

    replay: Callable
    label: str
    count: int  # the first ``count`` args are what it takes; the rest, the size symbols they read
    description: str


def _replay_call(bsym, w):
    f = bsym.fields
    values = ", ".join(template_code(v, w) for v in bsym.args[:f.count])
    return [f"{w.constant(f.replay, f.label)}({values})  # {f.description}"]


REPLAY_CALL = Glue("replay_call", _replay_call, ReplayCall)
RETURN_VALUE = Glue("return_value", lambda b, w: [f"return {template_code(b.args[0], w)}"])


def _all_glue() -> dict[str, Glue]:
    """Every glue symbol by its printed name (each name is one symbol's)."""
    found: dict[str, Glue] = {}
    for value in list(globals().values()):
        if isinstance(value, Glue):
            assert value.name not in found, f"two glue symbols are called {value.name!r}"
            found[value.name] = value
    return found


ALL = _all_glue()
