"""How a torch callable is written in a trace: ``torch.nn.functional.linear``, ``x.view``, ``a + b``.

Names come from PyTorch's public namespaces, found once by identity, so the trace reads like the
user's code and runs as written.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from ..torch_internals.dispatch import OpOverload, OpOverloadPacket
from ..core.symbols import TorchSymbol

_PUBLIC_NAMESPACES = ("torch", "torch.nn.functional", "torch.linalg", "torch.special", "torch.fft",
                      "torch.nn.init", "torch.autograd")
_OPERATORS = {
    f"__{op}__" for base in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and",
                             "or", "xor", "lshift", "rshift")
    for op in (base, "r" + base, "i" + base)
} | {f"__{op}__" for op in ("eq", "ne", "lt", "le", "gt", "ge", "neg", "pos", "invert", "abs")}


@functools.lru_cache(maxsize=None)
def _public_function_names() -> dict[int, str]:
    names: dict[int, str] = {}
    for namespace in reversed(_PUBLIC_NAMESPACES):  # torch.* wins over the same object elsewhere
        mod = eval(namespace, {"torch": torch})
        for attr in dir(mod):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            if callable(obj) and not isinstance(obj, type):
                names[id(obj)] = f"{namespace}.{attr}"
    return names


@functools.lru_cache(maxsize=None)
def _tensor_method_names() -> dict[int, str]:
    names: dict[int, str] = {}
    for attr in dir(torch.Tensor):
        obj = getattr(torch.Tensor, attr, None)
        if obj is None or not callable(obj):
            continue
        previous = names.get(id(obj))
        # Prefer operators (print as `a + b`), then plain method names, then other dunders.
        rank = 0 if attr in _OPERATORS or attr in ("__getitem__", "__setitem__") else (
            1 if not attr.startswith("_") else 2)
        if previous is None or rank < previous[1]:
            names[id(obj)] = (attr, rank)
    return {k: v[0] for k, v in names.items()}


def torch_symbol(func: Callable) -> TorchSymbol:
    """The symbol for a callable seen by the torch function mode."""
    if type(func).__name__ == "method-wrapper" and func.__name__ == "__get__":
        return TorchSymbol(func, func.__self__.__name__, "getter")
    if isinstance(func, (OpOverload, OpOverloadPacket)):
        return TorchSymbol(func, f"torch.ops.{func}", "function")
    method = _tensor_method_names().get(id(func))
    if method is not None:
        if method == "__getitem__":
            return TorchSymbol(func, method, "getitem")
        if method == "__setitem__":
            return TorchSymbol(func, method, "setitem")
        if method in _OPERATORS:
            return TorchSymbol(func, method, "operator")
        return TorchSymbol(func, method, "method")
    public = _public_function_names().get(id(func))
    if public is not None:
        return TorchSymbol(func, public, "function")
    qualname = f"{getattr(func, '__module__', None) or ''}.{getattr(func, '__qualname__', '')}"
    try:
        if qualname.startswith("torch.") and eval(qualname, {"torch": torch}) is func:
            return TorchSymbol(func, qualname, "function")
    except Exception:
        pass
    return TorchSymbol(func, getattr(func, "__name__", "fn"), "opaque")

