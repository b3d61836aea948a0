"""The inputs part of the capture context: what comes into the program from outside it.

It owns the capture's inputs and their provenance: the fake and proxy of every tensor input
(``tensor_input``) and the stand-in of every other value (``value_input``), with the guards
that taking each in records; the tables that map fakes to proxies and storages; where each
module, parameter and buffer of the module tree lives, for values that reach the program
without a read capture saw (``real_tensor_reached_program``); and the proxies of recorded
lines' tensors (``proxy``, ``output_proxy``).
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict, abc, defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from ..torch_internals.dispatch import DisableTorchFunction
from ..torch_internals.fake import FakeTensor
from ..core.provenance import (ATTR, BUFFER, ITEM, KEYS_OF, PARAMETER, SUBMODULE, VALUES_OF,
                               FoundByName, Path, root)
from ..core.glue import RELEASE_GRAD
from ..core.proxies import TensorProxy
from ..core.symbolic import SymbolicUnsupported
from ..core.tags import STATIC_MEMORY_LOCATION
from ..errors import CaptureError, UnsupportedInputError, user_source
from . import guards
from .guards import is_plain
from .dtensor import dtensor_input, is_capture_dtensor, is_device_mesh, is_dtensor
from .leaks import is_tensor_subclass_with_dispatch
from .reads import AttributeWrite
from .recording import original_class
from .symbolic import _from_call


@dataclass
class TensorInput:
    """A tensor the program reads that comes from outside it."""

    path: Path
    real: torch.Tensor
    fake: FakeTensor
    proxy: TensorProxy
    grad_at_entry: Any = None  # the fake's .grad as taking it in made it (see ``input_grad``)


class InputsMixin:
    """Taking values into the capture. Part of ``CaptureContext``: it uses the context's
    ``names``, ``fake_mode``, ``dynamic``, ``symbols``, ``arg_names``, ``root_objects``,
    ``guards`` and ``guard``, the reads part's ``_watch_object`` and ``_object_paths``, and the
    scope guards' ``path_of``."""

    def _init_inputs(self, module: torch.nn.Module | None) -> None:
        self.inputs: list[TensorInput] = []
        self._input_by_real: dict[int, TensorInput] = {}
        self._input_by_fake: dict[int, TensorInput] = {}
        self.proxy_of: dict[int, TensorProxy] = {}   # id(fake) -> proxy
        self.storage_of: dict[str, int] = {}        # proxy name -> fake storage key
        self.fake_of: dict[str, FakeTensor] = {}     # proxy name -> fake
        # (path, stand-in, contents at the start): list and dict arguments the program may change.
        self.containers: list[tuple[Path, Any, Any]] = []
        # Where each module, parameter and buffer of the tree lives, for values that reach the
        # program without an attribute read we saw (ModuleList iteration, self.parameters()).
        self.module_paths: dict[int, Path] = {}
        self.tensor_paths: dict[int, Path] = {}
        # id(fake) -> the ``.grad`` the program gave that input (a fake, or None): later reads see
        # it, and the epilogue writes it (``write_grad``).
        self._grads_written: dict[int, Any] = {}
        if module is not None:
            self._index_module_tree(module)
        self.tree_modules = set(self.module_paths)

    def _index_module_tree(self, module: torch.nn.Module) -> None:
        for name, sub in module.named_modules(remove_duplicate=False):
            path = root("module")
            for part in name.split(".") if name else []:
                path = Path(path, SUBMODULE, part)
            self.module_paths.setdefault(id(sub), path)
            for kind, table in ((PARAMETER, sub._parameters), (BUFFER, sub._buffers)):
                for key, t in table.items():
                    if t is not None:
                        self.tensor_paths.setdefault(id(t), Path(path, kind, key))

    def tensor_input(self, real: torch.Tensor, path: Path, tags=()) -> FakeTensor:
        if is_dtensor(real):  # flattened to its local tensor: see dtensor.py
            return dtensor_input(self, real, path, tags)
        if is_tensor_subclass_with_dispatch(real):
            raise UnsupportedInputError(
                f"keraunos.jit: {path} is a {type(real).__qualname__}, a tensor subclass that "
                f"runs its own __torch_dispatch__ (a quantized or nested tensor, ...); keraunos "
                f"captures through DTensor only, and taking it for a plain tensor would compute "
                f"something else.\n  What to do: pass its plain tensor (.to_dense(), "
                f".dequantize()), or call this part outside the jitted function "
                f"(torch.compile(..., backend=\"keraunos\") does not take them either yet).")
        if real.layout != torch.strided:
            raise UnsupportedInputError(
                f"keraunos.jit: {path} is a {real.layout} tensor; keraunos captures strided "
                f"(dense) tensors only. Convert it with .to_dense(), or call this op outside the "
                f"jitted function.")
        known = self._input_by_real.get(id(real))
        if known is not None:
            if known.path != path:
                self.guard(guards.IDENTITY, path, known)  # the same tensor reached two ways
            return known.fake
        dynamic = self.dynamic.tensor_dims(real, path) if self.dynamic is not None else None
        with self.fake_mode, DisableTorchFunction():  # conversion is not the program
            fake = None
            if dynamic is not None and any(d and n > 1 for d, n in zip(dynamic, real.shape)):
                try:
                    fake = self.symbols.tensor_fake(real, path, dynamic)
                except SymbolicUnsupported:
                    fake = None  # this input keeps its exact sizes
            if fake is None:
                fake = self.fake_mode.from_tensor(real)
        hint = path.name_hint()
        if path.parent is not None and path.parent.is_root and path.parent.key == "args":
            hint = self.arg_names.get(path.key, hint)
        elif path.parent is not None and path.parent.is_root and path.parent.key == "kwargs":
            hint = str(path.key)
        proxy = TensorProxy(self.names.fresh(hint), fake, set(tags), str(path))
        if self.symbols is not None:
            self.symbols.bind_tensor(fake, proxy, path)
        with DisableTorchFunction():
            # (a non-leaf's ``.grad`` is None unless it retains it; reading it warns)
            grad = fake.grad if fake.is_leaf or fake.retains_grad else None
            entry = TensorInput(path, real, fake, proxy, grad)
        self.inputs.append(entry)
        self._input_by_real[id(real)] = entry
        self._input_by_fake[id(fake)] = entry
        self._register(fake, proxy)
        return fake

    def input_grad(self, fake: FakeTensor, grad_now: Any) -> Any:
        """``x.grad`` of a tensor input ``x``, read by the program (an optimizer reads each
        parameter's): while the program has not set it, it is what the call passes, so it is an
        input of its own at ``x``'s path, ``.grad``, checked like any (``None`` by value: an
        optimizer skips a parameter without a gradient). ``grad_now`` is the stand-in's
        ``.grad``; a gradient the program made (a backward inside it) is the program's own."""
        entry = self._input_by_fake.get(id(fake))
        if entry is None or id(fake) in self._grads_written or \
                grad_now is not entry.grad_at_entry:
            return grad_now
        path = Path(entry.path, ATTR, "grad")
        grad = entry.real.grad
        if grad is None:
            self.guard(guards.TENSOR_ATTRIBUTE, path, None)
            return None
        return self.tensor_input(grad, path)

    def write_grad(self, fake: FakeTensor, value: Any) -> None:
        """``x.grad = value`` by the program (``zero_grad(set_to_none=True)``, a backward's new
        gradient): made on the stand-in, so that later reads see it, and written by the
        epilogue when ``x`` is an input."""
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            value = self.real_tensor_reached_program(value)
        with DisableTorchFunction():
            fake.grad = value
        entry = self._input_by_fake.get(id(fake))
        if entry is not None:
            self._grads_written[id(fake)] = value
            self.attribute_writes.append(AttributeWrite(entry.path, "grad", value))
            if value is None:
                self.emit(RELEASE_GRAD.bind(entry.proxy, source=user_source()))

    def current_grad(self, fake: FakeTensor) -> Any:
        """``x.grad`` as the program reads it now (see ``input_grad``)."""
        with DisableTorchFunction():
            now = fake.grad
        return self.input_grad(fake, now)

    def input_entry(self, fake: torch.Tensor) -> TensorInput | None:
        return self._input_by_fake.get(id(fake))

    def _register(self, fake: FakeTensor, proxy: TensorProxy) -> None:
        self.proxy_of[id(fake)] = proxy
        self.fake_of[proxy.name] = fake  # also keeps the fake alive, so ids stay unique
        self.storage_of[proxy.name] = fake.untyped_storage()._cdata

    def value_input(self, value: Any, path: Path, tags=()) -> Any:
        """The stand-in the program sees for ``value`` found at ``path``; records its guards."""
        if isinstance(value, torch.Tensor):
            return self.tensor_input(value, path, tags)
        if type(value) is int and self.dynamic is not None and \
                self.dynamic.int_is_dynamic(value, path):
            symint, proxy = self.symbols.int_input(value, path)
            if proxy is not None:
                self.guard(guards.SYMBOLIC_INT, path, proxy)
                return symint
        if type(value) is float and self.dynamic is not None and \
                self.dynamic.float_is_dynamic(value, path):
            symfloat, proxy = self.symbols.float_input(value, path)
            self.guard(guards.SYMBOLIC_FLOAT, path, proxy)
            return symfloat
        # A list or dict that came with the call (an argument, or held by an object passed in: a
        # cache's list of layers) or that the module holds (a cache of computed tensors, such as
        # timm's ``attention_bias_cache``) is a container the program may change, even while it
        # holds only plain values: the program gets a stand-in, and the epilogue replays its
        # changes. The user's container never sees a value of capture's.
        held = type(value) in (list, dict) and (_from_call(path) or path.is_module_derived())
        if is_plain(value) and not path.is_root and not held:
            self.guard(guards.VALUE, path, value)
            return value
        if type(value) in (tuple, list) or _is_namedtuple(value):
            self.guard(guards.LENGTH, path, (type(value), len(value)))
            items = [self.value_input(v, Path(path, ITEM, i), tags) for i, v in enumerate(value)]
            stand_in = type(value)(*items) if _is_namedtuple(value) else type(value)(items)
            if type(value) is list:
                self.containers.append((path, stand_in, list(stand_in)))
            return stand_in
        if type(value) is dict:
            self.guard(guards.KEYS, path, (dict, tuple(value)))
            stand_in = {k: self.value_input(v, Path(path, ITEM, k), tags)
                        for k, v in value.items()}
            self.containers.append((path, stand_in, dict(stand_in)))
            return stand_in
        if dataclasses.is_dataclass(value) and not isinstance(value, type) and not path.is_attr:
            self.guard(guards.TYPE, path, type(value))
            copy = object.__new__(type(value))
            for f in dataclasses.fields(value):
                v = getattr(value, f.name)
                object.__setattr__(copy, f.name, self.value_input(v, Path(path, ATTR, f.name), tags))
            return copy
        if is_device_mesh(value):
            # A DTensor's mesh (dynamo's graphs take it as an argument): the very same mesh.
            self.guard(guards.IDENTITY, path, value)
            return value
        if _found_by_name(path):
            # Held by an object the program found by name (``cfg.inner``, ``cfg.act``): the very
            # same object, watched as its holder is (reads guarded; a write undone, and the
            # fallback route). A container of another kind (an OrderedDict, a set) is read in C,
            # unseen: it cannot be checked.
            if type(value) in HELD_MAPPINGS:
                return self._held_mapping_input(value, path)
            if isinstance(value, (abc.Mapping, abc.Set, abc.MutableSequence)):
                raise UnsupportedInputError(_unsupported_input_message(path, value))
            self.guard(guards.IDENTITY, path, value)
            self.watch_scope_object(value, path)
            return value
        if path.is_module_derived() or path.key in ("globals", "closure"):
            # Anything else the module or function holds (a config object, a function) must be the
            # very same object; plain objects are also watched field by field as they are read.
            self.guard(guards.IDENTITY, path, value)
            self._watch_object(value, path)
            return value
        if _from_call(path) and isinstance(value, PASSED_AS_THEMSELVES):
            return self._passed_as_itself(value, path)
        if not path.is_root and _from_call(path) and self._watch_object(value, path,
                                                                         writable=True):
            # A plain object passed in (a KV cache): its class is checked, each attribute the
            # program reads is an input with its own checks, and its writes are replayed.
            self.guard(guards.TYPE, path, original_class(value))
            return value
        raise UnsupportedInputError(_unsupported_input_message(path, value))

    def _passed_as_itself(self, value: Any, path: Path) -> Any:
        """A module, an optimizer or an LR scheduler passed in (``train_step(model, optimizer,
        x, y)``): the very same object on every call (checked at ``path``), read as if the
        program found it by name, from the prologue's own reference to it."""
        self.guard(guards.IDENTITY, path, value)
        key = FoundByName(f"<{path} passed in>")
        self.root_objects[key] = value
        self.watch_scope_object(value, root(key))
        return value

    def _held_mapping_input(self, value: dict, path: Path) -> dict:
        """An ``OrderedDict`` or ``defaultdict`` held by an object the program finds by name (an
        optimizer's hooks and its ``state``): read in C, so it is checked whole. The very same
        mapping, with the same keys in the same order, each value taken in as any value at its
        path is. Plain keys are compared by value (``hooks[3]``); tensor keys (``state[p]``, keyed
        by parameters) are taken in by position (``list(state)[i]``, whose values are
        ``list(state.values())[i]``), so that a key the program also reads elsewhere is checked
        to be that very tensor. The program gets a stand-in keyed by the keys' stand-ins;
        entries it adds are state made on this call (``LazyStateError``), anything else it
        changes is refused (``ScopeMutationError``)."""
        self.guard(guards.IDENTITY, path, value)
        keys = list(value)
        if all(is_plain(k) for k in keys):
            self.guard(guards.KEYS, path, (type(value), tuple(keys)))
            items = [(k, self.value_input(v, Path(path, ITEM, k))) for k, v in value.items()]
        elif all(isinstance(k, torch.Tensor) for k in keys):
            keys_path, values_path = Path(path, KEYS_OF, None), Path(path, VALUES_OF, None)
            self.guard(guards.LENGTH, keys_path, (list, len(keys)))
            self.guard(guards.LENGTH, values_path, (list, len(keys)))
            items = [(self.tensor_input(k, Path(keys_path, ITEM, i)),
                      self.value_input(v, Path(values_path, ITEM, i)))
                     for i, (k, v) in enumerate(value.items())]
        else:
            raise UnsupportedInputError(_unsupported_input_message(path, value))
        stand_in = type(value)(value.default_factory) if type(value) is defaultdict \
            else type(value)()
        stand_in.update(items)
        self.scope_containers.watch(f"{path} (a {type(value).__name__})", stand_in)
        return stand_in

    def real_tensor_reached_program(self, t: torch.Tensor) -> FakeTensor:
        """A real tensor met inside the program: a parameter read without our seeing the read
        (``self.parameters()``), a global, a closure variable, or an object attribute."""
        if is_capture_dtensor(t):  # a stand-in, or a DTensor the program made
            return t
        path = self.tensor_paths.get(id(t))
        tags = (STATIC_MEMORY_LOCATION,)
        if path is None:
            path, tags = self._find_in_function_scope(t), ()
        return self.tensor_input(t, path, tags)

    def _find_in_function_scope(self, t: torch.Tensor) -> Path:
        path = self.scopes.path_of(t)
        if path is not None:
            return path
        # Held by some other object: the program keeps reading this very tensor.
        key = f"<captured tensor {id(t):#x}>"
        self.root_objects[key] = t
        return root(key)

    def saw_before_the_call(self, obj) -> bool:
        """Whether ``obj`` existed before the program ran, as far as capture can tell."""
        return (id(obj) in self._object_paths or id(obj) in self.module_paths
                or any(v is obj for v in self.root_objects.values())
                or any(g.kind is guards.IDENTITY and g.expected is obj for g in self.guards))

    def proxy(self, fake: torch.Tensor) -> TensorProxy:
        proxy = self.proxy_of.get(id(fake))
        if proxy is None:
            raise CaptureError(f"keraunos: internal error: a tensor of unknown origin reached "
                               f"{user_source()}. Please report this with the program.")
        return proxy

    def output_proxy(self, fake: torch.Tensor) -> TensorProxy:
        proxy = self.proxy_of.get(id(fake))
        if proxy is None:
            proxy = TensorProxy(self.names.fresh(), fake)
            self._register(fake, proxy)
        return proxy


# Mappings whose items the program reads in C, taken in whole (``_held_mapping_input``).
HELD_MAPPINGS = (OrderedDict, defaultdict)


# Objects a call may pass that keraunos reads as the very objects they are: their state (a
# module's parameters, an optimizer's hooks and state) is read in C and cannot be stood in for.
PASSED_AS_THEMSELVES = (torch.nn.Module, torch.optim.Optimizer,
                        torch.optim.lr_scheduler.LRScheduler,
                        torch.optim.lr_scheduler.ReduceLROnPlateau)


def _found_by_name(path: Path) -> bool:
    """Whether ``path`` starts at something the program finds by name: the jitted function's
    globals or closure, a helper's (``scopes.py``), or a jitted bound method's object."""
    key = path.origin.key
    return key in ("globals", "closure") or isinstance(key, FoundByName)


def _is_namedtuple(value) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _unsupported_input_message(path, value) -> str:
    """Why ``value`` (passed at ``path``) cannot be an input, where the call was, and what to
    pass instead: NumPy values have an exact tensor or number equivalent."""
    kind = type(value)
    where = user_source()
    at = (f" (the call at {where.filename}:{where.lineno}{': ' + where.code if where.code else ''})"
          if where else "")
    message = (f"keraunos.jit: {path} is a {kind.__module__}.{kind.__qualname__}{at}, which "
               f"keraunos cannot check on later calls.")
    if kind.__module__ == "numpy" and kind.__name__ == "ndarray":
        return (f"{message} Pass a tensor instead: torch.from_numpy(array) shares the array's "
                f"memory; torch.as_tensor(array, dtype=..., device=...) converts it.")
    if kind.__module__ == "numpy" and hasattr(value, "item"):  # a NumPy scalar: np.float32(1.0)
        return f"{message} Pass a Python number instead: value.item(), or float(value)."
    return (f"{message} Pass tensors, numbers, strings, None, dtypes, devices, or "
            f"tuples/lists/dicts/dataclasses of those.")
