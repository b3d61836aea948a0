"""The examples of docs/architecture.md run and do what the page says."""
import pathlib
import re

import torch

from doc_examples import python_blocks
from helpers import check_grads
import keraunos

DOC = pathlib.Path(__file__).parent.parent / "docs" / "architecture.md"


def _doc_example(title: str) -> str:
    return python_blocks(DOC.read_text().split(f"## {title}", 1)[1])[0]


def test_doc_example_pass_drops_double_negation(capsys):
    namespace = {}
    exec(_doc_example("Example: a pass"), namespace)
    assert "Drop Double Negation" in capsys.readouterr().out
    f, x = namespace["f"], torch.randn(3)
    torch.testing.assert_close(f(x), x.exp())
    trace = keraunos.last_traces(namespace["f"])[-1]
    assert not [b for b in trace.bound_symbols
                if getattr(b.symbol, "fn", None) is torch.Tensor.__neg__]
    assert any("Drop Double Negation" in h for h in trace.header)


def test_doc_example_executor_runs_the_registered_implementation(capsys):
    namespace = {}
    exec(_doc_example("Example: an executor"), namespace)
    assert "_logged_gelu" in capsys.readouterr().out
    assert namespace["calls"] == [(3, 8)]
    jm, model = namespace["jm"], namespace["model"]
    x = torch.randn(5, 8)
    torch.testing.assert_close(jm(x), model(x))  # a new size: compiled again, same kernel
    assert namespace["calls"][-1] == (5, 8)


def test_operator_executor_checker_declines_and_torch_runs_the_line():
    calls = []
    mine = keraunos.executors.OperatorExecutor("float32_only_exp")
    mine.register_implementation(torch.exp, lambda x: calls.append(x.dtype) or torch.exp(x),
                                 checker=lambda x: x.dtype == torch.float32)
    keraunos.executors.register(mine)
    f = keraunos.jit(lambda x: torch.exp(x) + 1, executors=["float32_only_exp", "torch"])
    x64 = torch.randn(4, dtype=torch.float64)
    torch.testing.assert_close(f(x64), torch.exp(x64) + 1)
    assert calls == []
    x32 = torch.randn(4)
    torch.testing.assert_close(f(x32), torch.exp(x32) + 1)
    assert calls == [torch.float32]


def test_operator_executor_gradients_are_pytorchs_formula_for_the_op():
    mine = keraunos.executors.OperatorExecutor("plain_tanh")
    mine.register_implementation(torch.tanh, lambda x: torch.tanh(x))
    keraunos.executors.register(mine)
    check_grads(lambda t: torch.tanh(t * 2).sum(), torch.randn(6, requires_grad=True),
                executors=["plain_tanh", "torch"])


def test_the_layer_contract_holds_and_no_module_imports_in_a_cycle():
    """docs/architecture.md's layer table, as pyproject.toml's import-linter contract: no upward
    import; and no import cycle between any two modules of keraunos."""
    import subprocess
    import sys

    import grimp

    root = pathlib.Path(__file__).parent.parent
    lint = pathlib.Path(sys.executable).parent / "lint-imports"
    run = subprocess.run([str(lint), str(root / "pyproject.toml")], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "3 kept, 0 broken" in run.stdout

    graph = grimp.build_graph("keraunos")
    cycles = [(a, b) for a in sorted(graph.modules)
              for b in graph.find_modules_directly_imported_by(a)
              if graph.chain_exists(importer=b, imported=a)]
    assert cycles == []


def test_every_module_of_the_package_is_in_the_layer_contract():
    """The contract lists folders and loose modules; every module of keraunos falls in one of its
    layers, and every module of a folder with a contract of its own (``containers``) in one of
    that contract's layers: nothing new lands outside the table."""
    import tomllib

    import grimp

    root = pathlib.Path(__file__).parent.parent
    contracts = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"]

    def names(layers):
        return {name.strip() for layer in layers for name in layer.split("|")}

    top = names(next(c for c in contracts if "containers" not in c)["layers"])
    inner = {c["containers"][0]: names(c["layers"]) for c in contracts if "containers" in c}
    outside = []
    for module in sorted(grimp.build_graph("keraunos").modules):
        parts = module.split(".")
        if len(parts) == 1:
            continue
        if ".".join(parts[:2]) not in top:
            outside.append(module)
        container = ".".join(parts[:2])
        if container in inner and len(parts) > 2 and parts[2] not in inner[container]:
            outside.append(module)
    assert outside == [], outside
    assert set(inner) == {"keraunos.runtime", "keraunos.persist"}
