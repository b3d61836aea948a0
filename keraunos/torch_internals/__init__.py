"""torch's private machinery, in one place: every API of torch's that is not public (fake tensors,
dynamo's guards, Inductor, the C dispatcher's entry points, torch.fx's tracing flag) that keraunos
uses is reached through a module of this package, never named elsewhere in keraunos.

- ``fake``: fake tensors, their mode, the shape environment and symbolic sizes;
- ``dispatch``: the C dispatcher's entry points (dispatch keys, torch-function and
  torch-dispatch modes, storages and version counters, operator overloads, ``_VF``);
- ``autograd``: grad mode as the generated code sets it, saved-tensor hooks, forward-mode levels,
  ``autograd.Function.apply``'s descriptor;
- ``functorch``: functorch's interpreter stack and its vmap primitives;
- ``dynamo``: dynamo's C++ guards and eval-frame hook (imported with torch), the rest of dynamo
  (imported when first used);
- ``inductor``: Inductor's compiler, config, caches and vector-ISA probe (imported when first
  used);
- ``fx``: torch.fx's flag for a symbolic trace under way;
- ``jit``: the Python function a ``torch.jit.script`` function was made from;
- ``patching``: replacing attributes of torch's objects and giving the originals back.

Where an API differs between the torch releases keraunos supports (``keraunos.version``), the
module that owns it probes the installed torch and says which form it found. Importing this
package imports neither dynamo nor Inductor: their modules load on first use.
"""
from __future__ import annotations

import importlib
import sys
import threading
import warnings

# What torch's own modules may warn while they are first imported: their deprecations (importing
# Inductor defines ``torch.utils.mkldnn``'s ``torch.jit.script_method`` classes, deprecated from
# torch 2.13). A harness that turns warnings into errors around its code (``simplefilter
# ("error")``) would otherwise fail the import, and with it every fused region compiled on the
# user's thread, for a warning about torch's code that the user cannot act on.
_IMPORT_TIME_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


def import_module(module: str):
    """``importlib.import_module``, with the deprecations torch's modules warn about themselves
    while first imported kept quiet. The filters are the user's thread's to change: on
    keraunos's background thread a module is imported as it is (that thread imports nothing of
    torch's compiler stack, ``keraunos.background``); a module imported already is taken as
    it is."""
    found = sys.modules.get(module)
    if found is not None:
        return found
    if getattr(threading.current_thread(), "keraunos_background", False) \
            or not _errors_for_import_time_warnings():
        return importlib.import_module(module)
    with warnings.catch_warnings():
        for category in _IMPORT_TIME_WARNINGS:
            warnings.filterwarnings("ignore", category=category, module=r"torch(\.|$)")
        return importlib.import_module(module)


def _errors_for_import_time_warnings() -> bool:
    """Whether the filters may turn one of ``_IMPORT_TIME_WARNINGS`` into an error. Only then
    are the filters changed (for the import; ``catch_warnings`` swaps the one process-wide
    list, which other threads of the user's would see meanwhile)."""
    if warnings.defaultaction == "error":
        return True
    return any(action == "error" and any(issubclass(c, category) or issubclass(category, c)
                                         for c in _IMPORT_TIME_WARNINGS)
               for action, _, category, _, _ in warnings.filters)


def lazy(module_name: str, table: dict[str, tuple[str, str | None]]):
    """A module's ``__getattr__`` for ``table``: name -> (module, attribute, or None for the
    module itself), imported when first asked for."""
    def __getattr__(name: str):
        if name not in table:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        module, attribute = table[name]
        found = import_module(module)
        return found if attribute is None else getattr(found, attribute)
    return __getattr__
