"""What a compile helper process runs (``workers.Helper`` starts it): it reads a region's
description from its input, compiles it with Inductor under the parent's settings, and answers
with Inductor's generated module (``kernel_store.row``), which the parent loads. A process of
keraunos's own: Inductor's functions stay replaced for its life (``patches.apply_for_good``)."""
from __future__ import annotations

import contextlib
import pickle
import sys

import torch

from .workers import _Ref, _read, _write


def _graph_module(nodes: list):
    """The ``GraphModule`` of a pickled graph's nodes (in a helper)."""
    graph = torch.fx.Graph()
    made: dict[str, torch.fx.Node] = {}

    def find(value):
        if isinstance(value, _Ref):
            return made[value.name]
        if isinstance(value, (tuple, list)):
            return type(value)(find(v) for v in value)
        if isinstance(value, dict):
            return {k: find(v) for k, v in value.items()}
        if isinstance(value, slice):
            return slice(find(value.start), find(value.stop), find(value.step))
        return value
    for op, name, target, args, kwargs in nodes:
        made[name] = graph.create_node(op, target, find(args), find(kwargs), name=name)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _compile(nodes, metas, aliases, layout_choice, config_patches: dict,
             given: dict) -> bytes:
    """In a helper: compile the region as ``compiler._compile`` does (same inputs, same options,
    same settings), so that Inductor's caches hold it, and make the row a parent loads
    (``kernel_store.row``): the generated module, once a call of it alone is seen to give what
    a call through ``compile_fx``'s wrappers gives (``compiler._unwrapped``), on inputs of the
    region's layouts. Raises ``Refused`` where no row can be made."""
    from ...torch_internals.fake import FakeTensorMode, ShapeEnv, TracingContext, tracing
    from ...torch_internals.inductor import compile_fx
    from . import channels_last, collecting, compiler, kernel_store
    from .fx_graph import example_values
    _apply(given)
    graph_module = _graph_module(nodes)
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    with fake_mode:
        fakes = [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                 for shape, stride, dtype, device in metas]
    example_values(graph_module, fakes, fake_mode)
    # Collected as the parent collects them, so that the module's kernels are built as the
    # parent's load of it will ask for them: one file of them all (``one_build``).
    with torch.no_grad(), tracing(TracingContext(fake_mode)), \
            channels_last.inductor_layout(layout_choice), \
            collecting.from_inductor() as (_, pending):
        compiled = compile_fx(graph_module, fakes, ignore_shape_env=True,
                              config_patches=config_patches)
    for wait, scope in pending:
        wait(scope)
    if any(a != k for k, a in enumerate(aliases)):
        raise Refused("inputs that share memory")
    args = [torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()
            for shape, stride, dtype, device in metas]
    before = compiler.inputs_written_by(compiled, args)
    with torch.no_grad():
        outs = compiled(*args)
    graph = compiler._unwrapped(compiled, args, outs, before)
    if graph is None:
        raise Refused("its outputs share memory with its inputs (views), which only "
                      "compile_fx's wrappers remake")
    row = kernel_store.row(graph)
    if row is None:
        raise Refused("its generated module holds constants of its own")
    return row  # (the parent keeps it in the store)


class Refused(Exception):
    """A region compiled in a helper whose generated module alone cannot stand in for it."""


def _apply(given: dict) -> None:
    """In a helper: the parent's settings (``settings``), each set only where it differs:
    setting one to the value it has can change another that keys the cache
    (``set_float32_matmul_precision("highest")`` turns the per-backend ``fp32_precision`` from
    "none" into "ieee")."""
    from ...torch_internals.inductor import config
    if torch.get_num_threads() != given["threads"]:
        torch.set_num_threads(given["threads"])
    if torch.get_default_dtype() != given["default_dtype"]:
        torch.set_default_dtype(given["default_dtype"])
    mode, warn_only = given["deterministic"]
    if (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled()) != (mode, warn_only):
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = given["fill_uninitialized_memory"]
    if torch.get_float32_matmul_precision() != given["matmul_precision"]:
        torch.set_float32_matmul_precision(given["matmul_precision"])
    matmul = torch.backends.cuda.matmul
    precision, fp16, bf16 = given["cuda_matmul"]
    if matmul.fp32_precision != precision:
        matmul.fp32_precision = precision
    matmul.allow_fp16_reduced_precision_reduction = fp16
    matmul.allow_bf16_reduced_precision_reduction = bf16
    if torch.backends.mkldnn.enabled != given["mkldnn"]:
        torch.backends.mkldnn.enabled = given["mkldnn"]
    global _defaults
    if _defaults is None:
        _defaults = config.save_config_portable()
    config.load_config({**_defaults, **given["inductor_config"]})


_defaults: dict | None = None  # the Inductor config this process started with


def serve() -> None:
    """The loop of a helper process: read a job, compile it, answer (key, whether it
    compiled, the row it made, why not), until the parent closes the pipe."""
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write into the answers
    from ...torch_internals import inductor
    inductor.load_compiler()
    cpu_vec_isa = inductor.cpu_vec_isa
    from . import patches
    patches.apply_for_good()  # a process of keraunos's own
    with contextlib.suppress(Exception):  # (a compile meets and reports the same problem)
        cpu_vec_isa.pick_vec_isa()  # one thread here: no race for the probe's flags
    _write(sink, (None, True, None, ""))  # ready
    while True:
        try:
            key, payload = _read(source)
        except EOFError:
            return
        try:
            row, ok, reason = _compile(*pickle.loads(payload)), True, ""
        except Exception as e:  # noqa: BLE001 - the parent runs the region's lines unfused
            row, ok, reason = None, False, f"{type(e).__name__}: {e}"[:500]
        _write(sink, (key, ok, row, reason))
