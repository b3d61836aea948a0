"""functorch's interpreter stack (vmap, grad, jvp levels) and its vmap primitives, as the
``torch.func`` transforms drive them.

Owns whether a tensor is one of functorch's wrappers, whether a transform is active, the stack
of active transforms and leaving a level of one, and the pre-dispatch vmap functions the
``torch.compile`` backend's graphs call. Plain re-exports: the same in every supported release.
"""
from __future__ import annotations

import torch
import torch._functorch.predispatch as predispatch

is_functorch_wrapped_tensor = torch._C._functorch.is_functorch_wrapped_tensor
transforms_active = torch._C._are_functorch_transforms_active

vmap_increment_nesting = predispatch._vmap_increment_nesting
vmap_decrement_nesting = predispatch._vmap_decrement_nesting
add_batch_dim = predispatch._add_batch_dim
remove_batch_dim = predispatch._remove_batch_dim
lazy_load_decompositions = predispatch.lazy_load_decompositions

# Leaving the innermost level, by the kind of transform that entered it.
_DECREMENT = {"Vmap": "_vmap_decrement_nesting", "Grad": "_grad_decrement_nesting",
              "Jvp": "_jvp_decrement_nesting", "Functionalize": "_func_decrement_nesting"}


def depth() -> int:
    """How many transform levels are active on this thread."""
    return len(torch._C._functorch.get_interpreter_stack() or ())


def leave_innermost() -> None:
    """Leave the innermost transform level (its kind: vmap, grad, jvp or functionalize)."""
    kind = str(torch._C._functorch.get_interpreter_stack()[-1].key()).rsplit(".", 1)[-1]
    getattr(torch._C._functorch, _DECREMENT[kind])()


__all__ = ["add_batch_dim", "depth", "is_functorch_wrapped_tensor", "lazy_load_decompositions",
           "leave_innermost", "remove_batch_dim", "transforms_active", "vmap_decrement_nesting",
           "vmap_increment_nesting"]
