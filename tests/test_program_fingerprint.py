"""What the program store's code fingerprint follows (``program_fingerprint``): a change in code a
call may run changes it, a change in code no call reaches by name does not, and values are
hashed the same way in every process. In process, on classes and functions built from source
(``exec``) so that one test can compare two versions of one program."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import torch

from keraunos.persist.fingerprint import Unstorable, code_fingerprint, function_fingerprint
from helpers import ROOT

BASE = '''
import torch
from torch import nn

SCALE = 2.0

def helper(x):
    return x * SCALE

class Settings:
    def __init__(self, k):
        self.k = k

class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.scaled(self.fc(x))

    def scaled(self, x):
        return helper(x)

    def save(self, path):
        return "saved to " + path

    def extra_repr(self):
        return "layer"

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = Layer()

    def forward(self, x):
        return self.layer(x).relu() * Settings(1.0).k
'''


def _model(source: str) -> torch.nn.Module:
    module = types.ModuleType("fingerprinted")
    module.__file__ = "/nowhere/fingerprinted.py"  # not torch's, not the standard library's
    sys.modules[module.__name__] = module
    try:
        exec(compile(source, module.__file__, "exec"), vars(module))
        return module.Model()
    finally:
        del sys.modules[module.__name__]


def _key(source: str) -> str:
    model = _model(source)
    return code_fingerprint(model, model.forward)


def test_code_a_call_may_run_changes_the_fingerprint():
    base = _key(BASE)
    assert _key(BASE) == base
    # a method reached by its name, a global function it calls, a global value it reads
    assert _key(BASE.replace("return helper(x)", "return helper(x) + 1")) != base
    assert _key(BASE.replace("return x * SCALE", "return x / SCALE")) != base
    assert _key(BASE.replace("SCALE = 2.0", "SCALE = 3.0")) != base
    # a class the forward constructs: its __init__
    assert _key(BASE.replace("self.k = k", "self.k = -k")) != base
    # a method torch may call (it overrides nn.Module's extra_repr)
    assert _key(BASE.replace('return "layer"', 'return "a layer"')) != base


def test_code_no_call_reaches_by_name_leaves_the_fingerprint_as_it_is():
    base = _key(BASE)
    # ``save`` is never read by the code followed; a module's own __init__ never runs in a call
    assert _key(BASE.replace('"saved to " + path', '"written to " + path')) == base
    # (the same number of lines: each function's first line is in the key)
    assert _key(BASE.replace("self.fc = nn.Linear(4, 4)",
                             "self.fc = nn.Linear(4, 4, bias=True)")) == base


def test_functions_in_a_registry_are_followed_not_hashed_by_type():
    """A dict of functions (a registry such as transformers' ``ALL_ATTENTION_FUNCTIONS``): every
    function's type is ``builtins.function``, so hashing the dict as plain values would miss
    a function registered in place of another."""
    def double(x):
        return x * 2

    def triple(x):
        return x * 3

    registry = {"scale": double}

    def apply(x):
        return REGISTRY["scale"](x)  # noqa: F821 - a global of the namespace below

    fn = types.FunctionType(apply.__code__, {"REGISTRY": registry, "__name__": "fingerprinted"})
    first = function_fingerprint(fn)
    registry["scale"] = triple
    assert function_fingerprint(fn) != first
    registry["scale"] = double
    assert function_fingerprint(fn) == first


class _Buffer(bytearray):
    """An object whose state is in C (a ``bytearray``'s bytes), not in its ``__dict__``."""


def test_an_object_with_state_outside_python_is_not_hashed():
    def read(x):
        return x + BUFFER[0]  # noqa: F821 - a global of the namespace below

    fn = types.FunctionType(read.__code__, {"BUFFER": _Buffer(b"ab"), "__name__": "read"})
    try:
        function_fingerprint(fn)
    except Unstorable as e:
        assert "_Buffer" in str(e)
    else:
        raise AssertionError("an object whose state is in C was hashed")


def test_the_fingerprint_is_the_same_in_another_process():
    """Sets and dicts are hashed in sorted order: their iteration order follows the process's
    string hashing (``PYTHONHASHSEED``), which differs between processes."""
    script = textwrap.dedent('''
        import types
        from keraunos.persist.fingerprint import function_fingerprint
        def use(x):
            return x in NAMES and MAPPING[x]
        g = {"NAMES": frozenset("abcdefghij"), "MAPPING": {c: i for i, c in enumerate(set("klmnop"))},
             "__name__": "same"}
        g["MAPPING"] = {k: 1 for k in g["MAPPING"]}
        print(function_fingerprint(types.FunctionType(use.__code__, g)))
    ''')
    digests = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              check=True, env={"PYTHONHASHSEED": seed, "PYTHONPATH": ROOT}
                              ).stdout for seed in ("1", "2", "3")}
    assert len(digests) == 1, digests


def test_a_function_under_a_library_decorator_is_followed():
    """``functools.lru_cache`` and ``functools.cached_property`` wrap the program's own code in
    objects of the standard library; hashing those by their type alone left a changed helper
    out of the key, and a restart loaded the old program."""
    cached = BASE.replace("def helper(x):", "import functools\n@functools.lru_cache\ndef factor():\n"
                          "    return 2.0\n\ndef helper(x):").replace("return x * SCALE",
                                                                    "return x * factor()")
    assert _key(cached.replace("return 2.0", "return 3.0")) != _key(cached)
    prop = BASE.replace("    def save(self, path):", "    @functools.cached_property\n"
                        "    def gain(self):\n        return 2.0\n\n    def save(self, path):"
                        ).replace("return helper(x)", "return helper(x) * self.gain"
                                  ).replace("import torch\n", "import functools\nimport torch\n", 1)
    assert _key(prop.replace("return 2.0", "return 3.0")) != _key(prop)
