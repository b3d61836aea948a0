"""Comparing the jitted side with the eager side: values, types, identity and aliasing.

Each check raises ``Mismatch(check, detail)``; ``check`` names the kind of disagreement (the
shrinker keeps a reduced program only while the same kind persists), ``detail`` says where and what.
"""
from __future__ import annotations

import math

import torch

RTOL, ATOL = 1e-4, 1e-5


class Mismatch(Exception):
    """``path``, ``eager`` and ``jitted`` are set for a floating value mismatch: the classifier
    (``classify.py``) compares the two tensors with float64 eager at that path."""

    def __init__(self, check: str, detail: str, path: str = "", eager=None, jitted=None):
        super().__init__(f"{check}: {detail}")
        self.check = check
        self.detail = detail
        self.path, self.eager, self.jitted = path, eager, jitted


def flatten(tree, path: str = "out") -> list[tuple[str, object]]:
    """The leaves of a returned structure with their paths; ``torch.Size`` is a leaf."""
    if isinstance(tree, (tuple, list)) and not isinstance(tree, torch.Size):
        return [leaf for i, x in enumerate(tree) for leaf in flatten(x, f"{path}[{i}]")]
    if isinstance(tree, dict):
        return [leaf for k, x in tree.items() for leaf in flatten(x, f"{path}[{k!r}]")]
    return [(path, tree)]


def compare_tree(eager, jitted, path: str, check: str) -> None:
    """Same Python types and structure all the way down, and equal leaves."""
    if type(eager) is not type(jitted):
        raise Mismatch(f"{check} type", f"{path}: eager {type(eager).__name__}, "
                                        f"jit {type(jitted).__name__}")
    if isinstance(eager, torch.Tensor):
        problem = tensor_problem(eager, jitted)
        if problem:
            floating = problem[0] == "value" and eager.is_floating_point()
            raise Mismatch(f"{check} {problem[0]}", f"{path}: {problem[1]}",
                           *((path, eager.detach().clone(), jitted.detach().clone()) if floating else ()))
    elif isinstance(eager, (tuple, list)) and not isinstance(eager, torch.Size):
        if len(eager) != len(jitted):
            raise Mismatch(f"{check} structure", f"{path}: length {len(eager)} vs {len(jitted)}")
        for i, (e, j) in enumerate(zip(eager, jitted)):
            compare_tree(e, j, f"{path}[{i}]", check)
    elif isinstance(eager, dict):
        if list(eager) != list(jitted):
            raise Mismatch(f"{check} structure", f"{path}: keys {list(eager)} vs {list(jitted)}")
        for k in eager:
            compare_tree(eager[k], jitted[k], f"{path}[{k!r}]", check)
    elif isinstance(eager, float):
        same = (math.isnan(eager) and math.isnan(jitted)) or (
            eager == jitted and math.copysign(1, eager) == math.copysign(1, jitted))
        if not same:
            raise Mismatch(f"{check} value", f"{path}: eager {eager!r}, jit {jitted!r}")
    elif eager != jitted:
        raise Mismatch(f"{check} value", f"{path}: eager {eager!r}, jit {jitted!r}")


def tensor_problem(eager: torch.Tensor, jitted: torch.Tensor) -> tuple[str, str] | None:
    """What differs between two tensors (metadata first, then values), or None."""
    for what, e, j in (("shape", eager.shape, jitted.shape), ("dtype", eager.dtype, jitted.dtype),
                       ("device", eager.device, jitted.device),
                       ("requires_grad", eager.requires_grad, jitted.requires_grad),
                       ("grad_fn", _grad_fn_state(eager), _grad_fn_state(jitted))):
        if e != j:
            return what, f"eager {e}, jit {j}"
    if _strides(eager) != _strides(jitted):
        return "stride", f"eager {eager.stride()}, jit {jitted.stride()} (shape {tuple(eager.shape)})"
    with torch.no_grad():
        e, j = eager.detach(), jitted.detach()
        if e.is_floating_point() or e.is_complex():
            e, j = e.to(torch.float64), j.to(torch.float64)
            close = torch.isclose(j, e, rtol=RTOL, atol=ATOL, equal_nan=True)
            if not bool(close.all()):
                return "value", f"eager {_show(e)}, jit {_show(j)}"
        elif not torch.equal(e, j):
            return "value", f"eager {_show(e)}, jit {_show(j)}"
    return None


def _grad_fn_state(t: torch.Tensor) -> str:
    try:
        return "none" if t.grad_fn is None else "set"
    except RuntimeError:  # a no-grad view whose base was written in place since: autograd refuses
        return "refused by autograd"


def _strides(t: torch.Tensor) -> tuple:
    """Strides where they matter: dimensions of size 1 may have any stride."""
    return tuple(s for s, n in zip(t.stride(), t.shape) if n > 1) if t.numel() > 1 else ()


def _show(t: torch.Tensor) -> str:
    return str(t.flatten()[:8].tolist()) + ("..." if t.numel() > 8 else "")


def roles(outputs: list[tuple[str, object]], known: list[tuple[str, torch.Tensor]]):
    """For each returned tensor: which known object it *is*, or which earlier output; and which
    known tensors and earlier outputs it shares memory with (and at which offset and strides)."""
    result = []
    for i, (path, value) in enumerate(outputs):
        if not isinstance(value, torch.Tensor):
            result.append(None)
            continue
        identity = next((label for label, t in known if t is value), None)
        if identity is None:
            identity = next((p for p, v in outputs[:i] if v is value), None)
        shares = frozenset(
            (label, value.storage_offset() - t.storage_offset(), value.stride())
            for label, t in known + [(p, v) for p, v in outputs[:i] if isinstance(v, torch.Tensor)]
            if _same_storage(value, t))
        result.append((identity, shares))
    return result


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0 or a.layout != torch.strided or b.layout != torch.strided:
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def compare_roles(eager_outputs, jit_outputs, eager_known, jit_known) -> None:
    for (path, _), e, j in zip(eager_outputs, roles(eager_outputs, eager_known),
                               roles(jit_outputs, jit_known)):
        if e is None:
            continue
        if e[0] != j[0]:
            raise Mismatch("output identity", f"{path}: eager returns the object {e[0]}, "
                                              f"jit returns {j[0] or 'a new object'}")
        if e[1] != j[1]:
            raise Mismatch("output aliasing", f"{path}: shares memory with eager {sorted(e[1])}, "
                                              f"jit {sorted(j[1])}")


def module_state(model) -> dict[str, object]:
    """Parameters, buffers, their gradients, and plain attributes of every submodule."""
    if model is None:
        return {}
    state = {}
    for name, p in model.named_parameters():
        state[f"parameter {name}"] = p
        state[f"grad of parameter {name}"] = p.grad
    for name, b in model.named_buffers():
        state[f"buffer {name}"] = b
    for prefix, m in model.named_modules():
        for key, value in vars(m).items():
            if not key.startswith("_") and not callable(value):
                state[f"attribute {prefix + '.' if prefix else ''}{key}"] = value
    return state


def compare_states(eager: dict, jitted: dict, check: str) -> None:
    if list(eager) != list(jitted):
        raise Mismatch(f"{check} structure", f"eager has {sorted(set(eager) - set(jitted))}, "
                                             f"jit has {sorted(set(jitted) - set(eager))}")
    for key in eager:
        compare_tree(eager[key], jitted[key], key, check)
