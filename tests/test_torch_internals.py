"""keraunos reaches torch's private machinery only through ``keraunos.torch_internals``, whose
modules import and probe the installed torch sensibly."""
import json
import pathlib
import re
import subprocess
import sys

import torch

import keraunos
from keraunos import version
from keraunos.torch_internals import (autograd, dispatch, dynamo, fake, functorch, fx, inductor,
                                      patching)

PACKAGE = pathlib.Path(keraunos.__file__).parent
BOUNDARY = PACKAGE / "torch_internals"
PRIVATE = re.compile(r"torch\._[A-Za-z]")


def test_no_module_outside_the_boundary_names_torch_private_api():
    # Comments and docstrings count too: they name the subsystem instead.
    found = [f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
             for path in sorted(PACKAGE.rglob("*.py")) if BOUNDARY not in path.parents
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if PRIVATE.search(line)]
    assert not found, "torch's private API named outside keraunos/torch_internals:\n" + \
        "\n".join(found)


def test_the_boundary_imports_nothing_of_keraunos():
    for path in BOUNDARY.glob("*.py"):
        assert not re.search(r"^\s*from \.\.|^\s*import keraunos|^\s*from keraunos",
                             path.read_text(), re.M), path.name


def test_importing_keraunos_imports_neither_dynamo_nor_inductor():
    code = ("import sys, json, keraunos\n"
            "print(json.dumps(sorted(m for m in sys.modules\n"
            "                        if m.startswith(('torch._dynamo', 'torch._inductor')))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=PACKAGE.parent)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_every_module_has_a_docstring_saying_what_it_owns():
    for module in (autograd, dispatch, dynamo, fake, functorch, fx, inductor, patching):
        assert module.__doc__ and len(module.__doc__) > 80, module.__name__


def _release():
    return version.release_of(torch.__version__)


def test_function_apply_descriptor_probe_matches_the_release():
    kind = autograd.apply_descriptor_kind()
    assert kind == ("classmethod" if _release() <= (2, 13) else "classmethod_descriptor")


def test_apply_of_binds_a_function_subclass():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    assert autograd.apply_of(Double)(torch.ones(2)).tolist() == [2.0, 2.0]


def test_global_state_fields_probe_is_within_the_known_fields():
    fields = dynamo.global_state_fields()
    assert dynamo.GlobalStateGuard is not None and fields
    assert fields <= dynamo.GLOBAL_STATE_FIELDS
    assert ("cuda_matmul_precision" in fields) == (_release() >= (2, 15))


def test_binding_convention_probe_matches_the_release():
    assert inductor.binding_convention() == (
        "METH_VARARGS" if _release() <= (2, 14) else "METH_FASTCALL")
    assert inductor.binding_template_parts() is not None


def test_fx_tracing_flag_probe_and_round_trip():
    assert fx.flag_is_per_thread() == (_release() >= (2, 14))
    assert fx.tracing() is False
    fx.set_tracing(True)
    try:
        assert fx.tracing() is True
    finally:
        fx.set_tracing(False)
    assert fx.tracing() is False


def test_inductor_attributes_resolve_on_first_use():
    assert callable(inductor.compile_fx)
    assert inductor.imported("compile_fx") and inductor.config_if_imported() is not None
    assert inductor.EXTERN_KERNELS_IMPORT.startswith("from torch.")


def test_dispatch_helpers_answer_for_a_plain_tensor():
    t = torch.ones(3)
    assert "CPU" in str(dispatch.dispatch_keys(t))
    assert dispatch.is_alias_of(t, t[1:]) and not dispatch.is_alias_of(t, torch.ones(3))
    assert dispatch.cxx11_abi() in (0, 1)
    assert isinstance(torch.ops.aten.add.Tensor, dispatch.OpOverload)
    assert isinstance(torch.ops.aten.add, dispatch.OpOverloadPacket)
    assert not functorch.is_functorch_wrapped_tensor(t) and functorch.depth() == 0


def test_fake_tensors_carry_shapes_without_data():
    with fake.FakeTensorMode(shape_env=fake.ShapeEnv()) as mode:
        x = torch.empty(2, 3)
    assert isinstance(x, fake.FakeTensor) and x.fake_mode is mode and x.shape == (2, 3)


def test_replaced_nests_and_gives_the_original_back():
    class Owner:
        def f(self):
            return "torch's"

    original = Owner.f

    def make(was):
        def f(self):
            return "ours, then " + was(self)
        return f

    with patching.replaced(lambda: [(Owner, "f", make)]):
        with patching.replaced(lambda: [(Owner, "f", make)]):
            assert Owner().f() == "ours, then torch's"
            assert patching.in_place() == ["Owner.f"]
        assert Owner().f() == "ours, then torch's"
    assert Owner.f is original and patching.in_place() == []


def test_swap_in_and_out():
    class Owner:
        value = 1
    swaps = [(Owner, "value", 2, 1)]
    patching.swap_in(swaps)
    assert Owner.value == 2
    patching.swap_out(swaps)
    assert Owner.value == 1


def test_scripted_function_keeps_the_python_it_was_made_from():
    from keraunos.torch_internals import jit

    def twice(x):
        return x * 2
    scripted = torch.jit.script(twice)
    assert isinstance(scripted, jit.SCRIPT_FUNCTION)
    assert jit.python_of(scripted) is twice
