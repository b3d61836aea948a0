"""Inductor: its compiler, config, caches, C++ toolchain and vector-ISA probe, every one imported
only when first used (``torch._inductor`` and what it imports cost about a second), through this
module's attributes: ``inductor.compile_fx`` or ``from .inductor import compile_fx`` inside a
function imports it then.

Owns ``compile_fx``, the config module, ``AsyncCompile`` and the compile pool's size, the code
caches (``PyCodeCache``, ``CppPythonBindingsCodeCache``), ``GraphLowering``,
``CompiledFxGraph``, the C++ compiler lookup, ``cpu_vec_isa``, ``extern_kernels`` and
``_align`` (and the import lines a generated module makes of them), the kernel cache directory,
and whether Triton is installed.

Release difference: Inductor's C++ binding template registers each kernel's Python function
with ``METH_VARARGS`` up to torch 2.14 and ``METH_FASTCALL`` from 2.15; ``binding_convention()``
says which this torch's template uses.
"""
from __future__ import annotations

import contextvars
import functools
import sys

from . import import_module, lazy

# name -> (module, attribute or None for the module itself): imported on first use.
_LAZY = {
    "compile_fx": ("torch._inductor.compile_fx", "compile_fx"),
    "config": ("torch._inductor.config", None),
    "cpu_vec_isa": ("torch._inductor.cpu_vec_isa", None),
    "AsyncCompile": ("torch._inductor.async_compile", "AsyncCompile"),
    "get_compile_threads": ("torch._inductor.async_compile", "get_compile_threads"),
    "CppPythonBindingsCodeCache": ("torch._inductor.codecache", "CppPythonBindingsCodeCache"),
    "PyCodeCache": ("torch._inductor.codecache", "PyCodeCache"),
    "GraphLowering": ("torch._inductor.graph", "GraphLowering"),
    "CompiledFxGraph": ("torch._inductor.output_code", "CompiledFxGraph"),
    "get_cpp_compiler": ("torch._inductor.cpp_builder", "get_cpp_compiler"),
    "extern_kernels": ("torch._inductor.select_algorithm", "extern_kernels"),
    "align": ("torch._inductor.codegen.memory_planning", "_align"),
    "cache_dir_utils": ("torch._inductor.runtime.cache_dir_utils", None),
    "has_triton": ("torch.utils._triton", "has_triton"),
}

CONFIG_MODULE = "torch._inductor.config"

# The lines a generated module imports ``extern_kernels`` and ``align`` with, and a function that
# imports ``align`` when first called instead.
EXTERN_KERNELS_IMPORT = "from torch._inductor.select_algorithm import extern_kernels\n"
ALIGN_IMPORT = "from torch._inductor.codegen.memory_planning import _align as align\n"
LAZY_ALIGN = """def align(nbytes):  # keraunos: Inductor's, imported when first called
    from torch._inductor.codegen.memory_planning import _align
    return _align(nbytes)
"""


__getattr__ = lazy(__name__, _LAZY)


def imported(name: str) -> bool:
    """Whether the process has imported Inductor's ``name`` (``compile_fx``, ``config``, ...)
    already, without importing it."""
    return _LAZY[name][0] in sys.modules


def config_if_imported():
    """Inductor's config module where the process imported it already, else None (then every
    entry has its default; importing it would import dynamo too)."""
    return sys.modules.get(CONFIG_MODULE)


def config_unset():
    """The marker torch's config entries hold for "not set by the environment" (None where the
    config machinery is not imported)."""
    return getattr(sys.modules.get("torch.utils._config_module"), "_UNSET_SENTINEL", None)


def config_overridden() -> list[tuple[str, object, object]] | None:
    """The Inductor config entries set here (``config.x = ...``, ``config.patch``): (name, the
    entry's record, the value set), read without serializing the config (from torch 2.15 that
    imports Inductor's lowering: a second on a restart). None where this torch keeps its config
    otherwise, or nothing of Inductor is imported.

    Release difference: an entry's override is a plain attribute up to torch 2.14 and a
    ``ContextVar`` from 2.15 (each thread and context sees its own); it is read as the calling
    thread sees it."""
    config = config_if_imported()
    entries = getattr(config, "_config", None)
    if not isinstance(entries, dict):
        return None
    unset = config_unset()
    found = []
    for name, entry in entries.items():
        value = getattr(entry, "user_override", unset)
        if isinstance(value, contextvars.ContextVar):
            value = value.get(unset)
        if value is not unset:
            found.append((name, entry, value))
    return found


def load_compiler() -> None:
    """Import Inductor's compiler now (a process that will compile pays for it up front)."""
    import_module("torch._inductor.compile_fx")


# The method table of Inductor's binding template, around its one entry (braces doubled: a
# format string).
BINDING_TABLE_OPEN = "static PyMethodDef py_methods[] = {{\n"
BINDING_TABLE_CLOSE = "    {{NULL, NULL, 0, NULL}}}};"


@functools.lru_cache(maxsize=None)
def binding_template_parts() -> tuple[str, str, str, str] | None:
    """Inductor's C++ binding template cut in four: what comes before the one function that
    parses the arguments and calls the kernel, that function, the method table's entry for it
    (which carries the calling convention, ``binding_convention()``), and what follows the table
    (the module and its init); each a format string of Inductor's (``{entry_func}``, ...). None
    when the template is not of that shape."""
    bindings = __getattr__("CppPythonBindingsCodeCache")
    template = bindings.suffix_template
    head, found, rest = template.partition("static PyObject* {entry_func}_py")
    if not found:
        return None
    function, found, table = rest.partition(BINDING_TABLE_OPEN)
    if not found or bindings.entry_function != "kernel" or \
            bindings.call_entry_function != "kernel({}); Py_RETURN_NONE;":
        return None
    entry, found, tail = table.partition(BINDING_TABLE_CLOSE)
    if not found or "{entry_func}_py" not in entry:
        return None
    return head, "static PyObject* {entry_func}_py" + function, entry, tail


def binding_parse_arg() -> str:
    """The template's extra argument-parsing code, for arrays of unknown length."""
    return __getattr__("CppPythonBindingsCodeCache").extra_parse_arg.format(array_len=-1)


def binding_convention() -> str:
    """How this torch's C++ binding template registers a kernel's Python function:
    "METH_VARARGS" (to torch 2.14), "METH_FASTCALL" (from 2.15), or "unknown"."""
    template = __getattr__("CppPythonBindingsCodeCache").suffix_template
    for convention in ("METH_FASTCALL", "METH_VARARGS"):
        if convention in template:
            return convention
    return "unknown"


__all__ = ["ALIGN_IMPORT", "BINDING_TABLE_CLOSE", "BINDING_TABLE_OPEN", "CONFIG_MODULE", "EXTERN_KERNELS_IMPORT", "LAZY_ALIGN",
           "binding_convention", "binding_parse_arg", "binding_template_parts",
           "config_if_imported", "config_unset", "imported",
           "load_compiler", *_LAZY]
