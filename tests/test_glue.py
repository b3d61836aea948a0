"""The glue vocabulary (keraunos/core/glue.py): each glue symbol defined once, with typed fields,
what it reads in its arguments as proxies, and compared by identity rather than by name."""
import ast
import dataclasses
import pathlib

import torch

import keraunos
from keraunos.core import glue
from keraunos.core.proxies import Proxy
from keraunos.core.symbols import BoundSymbol

PACKAGE = pathlib.Path(keraunos.__file__).parent


def _traces_of_a_training_step():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("steps", torch.zeros(()))

        def forward(self, x, cache):
            self.steps += 1  # a buffer written in place: a copy-back
            cache.append(x)  # a list the program changes
            return {"y": self.lin(x).relu(), "view": x[1:]}  # a returned view of an input
    jm = keraunos.jit(Block())
    x = torch.randn(3, 4, requires_grad=True)
    out = jm(x, [torch.ones(2)])
    out["y"].sum().backward()
    return (keraunos.last_prologue_traces(jm) + keraunos.last_traces(jm)
            + keraunos.last_epilogue_traces(jm) + keraunos.last_backward_traces(jm))


def test_every_builtin_glue_symbol_has_a_name_of_its_own():
    symbols = [v for v in vars(glue).values() if isinstance(v, glue.Glue)]
    assert len({s.name for s in symbols}) == len(symbols) == len(glue.ALL)
    assert sum(s.name.startswith("return") for s in symbols) == 6  # five returns, return_value
    assert glue.RETURNS <= set(symbols)


def test_glue_lines_carry_their_typed_record_and_read_proxies_only():
    traces = _traces_of_a_training_step()
    seen = set()
    for trace in traces:
        for b in trace.bound_symbols:
            if not isinstance(b.symbol, glue.Glue):
                continue
            seen.add(b.symbol)
            if b.symbol.fields is None:
                assert b.fields is None, b.symbol
            else:
                assert isinstance(b.fields, b.symbol.fields), b.symbol
                assert dataclasses.is_dataclass(b.fields)
            # What a glue line reads is in its args as proxies, never as name strings (values
            # the program writes or returns are templates, and may be strings).
            if b.symbol not in (glue.WRITE_ATTRIBUTE, glue.RETURN_VALUE):
                assert not [a for a in b.args if type(a) is str], b
    for expected in (glue.UNPACK, glue.CHECK, glue.CHECK_TENSOR, glue.RETURN_INPUTS, glue.RETURN,
                     glue.UNPACK_OUTPUTS, glue.COPY_BACK, glue.MAKE_VIEW, glue.WRITE_CONTAINER,
                     glue.RETURN_VALUE, glue.RETURN_FORWARD, glue.RETURN_GRADIENTS, glue.DELETE,
                     glue.PYTHON):
        assert expected in seen, expected.name


def test_a_delete_reads_the_proxies_it_frees():
    f = keraunos.jit(lambda x: (x.sin() * 2).cos())
    f(torch.randn(3))
    dels = [b for b in keraunos.last_traces(f)[-1].bound_symbols if b.symbol is glue.DELETE]
    assert dels and all(b.args and all(isinstance(p, Proxy) for p in b.args) for b in dels)


def test_glue_fields_are_not_a_free_form_dict():
    assert not hasattr(BoundSymbol(glue.RETURN, ([],)), "info")
    line = glue.CHECK_ALIAS.bind(index=0, description="d", paths=("a", "b"))
    assert line.fields.subject == "a"
    try:
        glue.RETURN.bind([], color="red")
    except TypeError as e:
        assert "no fields" in str(e)
    else:
        raise AssertionError("a field glue.RETURN does not have was accepted")


def _builtin_glue_names():
    return {s.name for s in glue.ALL.values()}


def test_no_module_recognises_glue_by_its_printed_name():
    """``b.symbol.name == "check_tensor"`` silently breaks when a name changes; identity
    (``b.symbol is glue.CHECK_TENSOR``) cannot."""
    names = _builtin_glue_names() | {"del", "return"}
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) \
                    and node.left.attr == "name":
                for c in node.comparators:
                    values = [c] + list(getattr(c, "elts", []))
                    if any(isinstance(v, ast.Constant) and v.value in names for v in values):
                        offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert offenders == []


def test_builtin_glue_is_defined_only_in_core_glue():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "glue.py" and path.parent.name == "core":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("Glue",
                                                                                 "GlueSymbol"):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert offenders == []
