"""torchvision's models on a machine whose torchvision wheel was built for another torch.

The torchvision 0.28.0 wheel that pip installs beside the CPU build of torch 2.13 is a CUDA build.
Its C++ extension does not load, and ``import torchvision`` then fails in
``torchvision/_meta_registrations.py`` with ``operator torchvision::nms does not exist``: that
module registers fake kernels for ``nms`` and ``qnms``, whose schemas the extension would have
defined. The models (``torchvision.models``) are pure Python and need none of it. Installed into
the environment, such a torchvision also breaks ``import lightning`` (torchmetrics imports it
whenever it is there), so ``scripts/setup.sh`` installs it into ``.venv/vendor`` instead, a
directory only this module puts on ``sys.path``.

``import_torchvision()`` imports torchvision as it is installed, else from ``.venv/vendor`` (or
``$KERAUNOS_VENDOR``); only when that import fails as above does it define the two schemas (no
kernels: calling a detection op still raises) and import again.
"""
from __future__ import annotations

import os
import sys
import types

import torch

# The schemas torchvision's extension defines for the two ops its import registers fakes for.
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library = None  # the torch.library.Library that holds the schemas; kept alive for the process


def vendor_dir() -> str:
    """Where scripts/setup.sh installs torchvision beside the environment."""
    return os.environ.get("KERAUNOS_VENDOR") or os.path.join(sys.prefix, "vendor")


def import_torchvision() -> types.ModuleType:
    """``torchvision``, imported; ImportError when neither the environment nor
    :func:`vendor_dir` has it."""
    try:
        return _import()
    except ModuleNotFoundError as error:
        if error.name != "torchvision" or not os.path.isdir(os.path.join(vendor_dir(),
                                                                         "torchvision")):
            raise
    sys.path.append(vendor_dir())  # after site-packages: it never shadows what is installed
    return _import()


def _import() -> types.ModuleType:
    global _library
    try:
        import torchvision
        return torchvision
    except RuntimeError as error:
        if "torchvision::nms does not exist" not in str(error):
            raise
    # The failed import left half-initialized modules behind; drop them before importing again.
    for name in [name for name in sys.modules if name.split(".")[0] == "torchvision"]:
        del sys.modules[name]
    if _library is None:
        _library = torch.library.Library("torchvision", "DEF")
        for schema in _SCHEMAS:
            _library.define(schema)
    import torchvision
    return torchvision
