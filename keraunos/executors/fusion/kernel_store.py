"""Inductor's compiled region graphs kept in keraunos's store, so that a restart loads a region's
kernel without running ``compile_fx`` again.

On a restart Inductor's own caches already spare the lowering and the g++ builds, but each
distinct region still goes through ``compile_fx``: the region graph's FakeTensor propagation,
AOTAutograd's and the FX graph cache's lookups (hashing torch's own source once per process), the
wrappers around the loaded graph. About 0.25 s a distinct region on this 2-core machine, most of
the fused tier's time on a warm restart. What a region's call needs is only Inductor's generated
wrapper module (its ``call`` and the C++ kernels it loads by their source's hash), so that is
what is kept: under a key of everything that decides the code (``fx_graph.region_key``: the
graph, each input's layout, which inputs share memory, threads, default dtype, Inductor's config,
torch's version) and of the machine it was generated for (the CPU's vector instructions, which
the kernels' source assumes), plus keraunos's version.

Only what a plain module can reproduce exactly is kept: a region whose graph Inductor ran past
``compile_fx``'s wrappers with the same outputs (``compiler.Kernel.direct`` checks it on the
first call: no input written, no output sharing an input's memory), with static sizes (a symbolic
region's guards are facts of a ShapeEnv that is not kept), no constants of the graph's own, on
the CPU. A stored module that does not load (a corrupted row that still checksums, a changed
torch) is a miss: the region is compiled as before. The C++ kernels themselves stay in Inductor's
cache directory; one that is gone is built again by the load.

A kept module imports no more of Inductor than its runtime (``codecache``, ``async_compile``):
two imports of Inductor's compiler that the generated header makes are rewritten when the row is
kept (``_lighter_imports``), so that a restart whose regions all come from here never imports
``compile_fx``, the lowering or ``select_algorithm`` (about 1 s of a 32-layer model's restart).
"""
from __future__ import annotations

import functools
import hashlib
import os
import pickle
import platform
import re

import torch

from ... import debug
from ...persist import store
from ...torch_internals import inductor
from ...version import __version__

NAMESPACE = "inductor-region"  # the store's namespace for these rows
FORMAT = 4                     # bump when what a row holds, or how it is loaded, changes


def key_of(region_key: tuple) -> str | None:
    """The store's key for a region of ``region_key`` (``fx_graph.region_key``), or None when
    such a region is not kept (symbolic sizes or a size symbol among its inputs; not the CPU)."""
    source, metas, aliases, environment, facts = region_key
    if facts is not None:
        return None
    for meta in metas:
        if meta[0] == "int":  # a size symbol passed in: the region is symbolic
            return None
        shape, stride, _, device = meta
        if device.type != "cpu" or not all(type(v) is int for v in (*shape, *stride)):
            return None
    text = repr((FORMAT, __version__, _machine(), _backends(), source, metas, aliases,
                 environment))
    return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def _machine() -> tuple:
    """What the generated C++ assumes of the machine: its architecture and vector instructions
    (the kernels' source is written for the widest the CPU has), and torch's build."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return (platform.machine(), platform.system(), hashlib.sha256(flags.encode()).hexdigest(),
            torch.__version__, torch.version.git_version)


def _backends() -> tuple:
    """Settings a lowering may read besides Inductor's config (read on every key: they can
    change between compiles). ``ATEN_CPU_CAPABILITY`` caps the vector instructions Inductor
    picks, which its C++ source is written for."""
    return (torch.get_float32_matmul_precision(), torch.backends.mkldnn.is_available(),
            torch.backends.mkldnn.enabled, os.environ.get("ATEN_CPU_CAPABILITY", ""))


def row(graph) -> bytes | None:
    """What is kept of ``graph`` (Inductor's ``CompiledFxGraph``): its generated module and the
    inputs it writes in place; None when its module alone does not reproduce it (constants)."""
    if (graph.constants or getattr(graph, "torchbind_constants", None)
            or getattr(graph, "opaque_value_type_classes", None)):
        return None
    source = getattr(graph, "source_code", None)
    if not source:
        return None
    return pickle.dumps({"source": _lighter_imports(source),
                         "writes": tuple(sorted(graph.mutated_input_idxs))})


def save(key: str, graph) -> bool:
    """Keep ``graph`` under ``key`` (``row``). Whether it was kept."""
    data = row(graph)
    if data is None:
        return False
    store.default_store().put(NAMESPACE, key, data)
    return True


def has(key: str) -> bool:
    return store.default_store().get(NAMESPACE, key) is not None


def stored(key: str) -> bytes | None:
    """The row kept under ``key`` (what ``load`` loads), or None."""
    return store.default_store().get(NAMESPACE, key)


def load(key: str, data: bytes | None = None):
    """The region's ``call`` (a list of inputs -> the outputs) from the module kept under
    ``key`` (``data``: its row, when the caller read it already), with the module's source and
    path and the positions of the inputs it writes; None when there is none, or it does not
    load. Run where Inductor's waits for C++ builds are collected
    (``collecting.from_inductor``): the module's kernels are then futures until the region's
    first call."""
    if data is None:
        data = stored(key)
    if data is None:
        return None
    try:
        kept = pickle.loads(data)
        source, writes = kept["source"], tuple(kept["writes"])
        from ...torch_internals.inductor import PyCodeCache
        module = PyCodeCache.load(source)
        return module.call, source, module.__file__, writes
    except Exception as e:  # noqa: BLE001 - any failure to load is a miss: the region is compiled
        debug.logger.debug("keraunos: a kept region's module did not load (%s: %s)",
                           type(e).__name__, e)
        return None


_EXTERN_KERNELS = inductor.EXTERN_KERNELS_IMPORT
_TORCH_AS_EXTERN_KERNELS = "import torch as extern_kernels  # keraunos: each one used is torch's\n"
_ALIGN = inductor.ALIGN_IMPORT
_LAZY_ALIGN = inductor.LAZY_ALIGN


def _lighter_imports(source: str) -> str:
    """``source`` without the two imports of Inductor's compiler that a generated module makes
    (a restart that only loads stored regions would pay about 1 s for them, on this machine):
    ``align`` from ``memory_planning`` becomes a function that imports it when first called
    (only memory-planned wrappers call it), and ``extern_kernels`` from ``select_algorithm``
    becomes ``torch`` when every ``extern_kernels.NAME`` the module uses is the object
    ``torch.NAME`` (``mm``, ``addmm``, ``bmm``: checked in this process, whose torch version is
    in the key); where any use is something else, or the name is used otherwise, it stays."""
    source = source.replace(_ALIGN, _LAZY_ALIGN)
    if _EXTERN_KERNELS not in source:
        return source
    extern_kernels = inductor.extern_kernels
    names = re.findall(r"\bextern_kernels\.(\w+)", source)
    every_use = len(re.findall(r"\bextern_kernels\b", source))
    if every_use != len(names) + source.count(_EXTERN_KERNELS):
        return source  # the namespace itself is used: only Inductor's will do
    for name in set(names):
        ours = getattr(extern_kernels, name, None)
        if ours is None or ours is not getattr(torch, name, None):
            return source
    return source.replace(_EXTERN_KERNELS, _TORCH_AS_EXTERN_KERNELS)
