"""A fuzzed program: Python source for a function or an ``nn.Module``, and the steps that drive it.

A ``Program`` is kept as lists of source pieces (globals and helpers, ``__init__`` lines, body
statements, returned items, steps) so that the shrinker can drop pieces and re-render; every
piece is plain Python, so a failure prints as a script anyone can run.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass, field, replace

PRELUDE = """\
import torch
import torch.nn as nn
import torch.nn.functional as F

D = 4
"""


@dataclass(frozen=True)
class Call:
    """One call of the program: ``source`` makes the arguments after ``torch.manual_seed(seed)``,
    ``args`` are the positional argument expressions and ``kwargs`` the keyword ones; every tensor
    the source names is compared after the call."""

    source: str
    seed: int
    args: tuple[str, ...] = ()
    kwargs: tuple[tuple[str, str], ...] = ()
    no_grad: bool = False

    @property
    def full_source(self) -> str:
        args = "".join(f"{a}, " for a in self.args)
        kwargs = ", ".join(f"{k!r}: {v}" for k, v in self.kwargs)
        return f"{self.source}\nargs = ({args})\nkwargs = {{{kwargs}}}"

    def render(self, target: str = "target") -> str:
        call = f"out = {target}(*args, **kwargs)"
        if self.no_grad:
            call = f"with torch.no_grad():\n    {call}"
        return f"torch.manual_seed({self.seed})\n{self.full_source}\n{call}"


@dataclass(frozen=True)
class Change:
    """A state change between calls, run on both sides with ``model`` (the module, or None),
    ``target`` (the jitted wrapper or the eager module), ``G`` (the program's globals) and the
    program's own names in scope, after ``torch.manual_seed(seed)``."""

    source: str
    seed: int

    def render(self, target: str = "target") -> str:
        return f"torch.manual_seed({self.seed})\n{self.source}"


@dataclass(frozen=True)
class Program:
    name: str                     # "<seed>:<index>", how the CLI finds it again
    kind: str                     # "function" or "module"
    params: tuple[str, ...]       # the forward's / function's parameter names
    header: tuple[str, ...]       # module-level globals and helper functions
    sub_init: tuple[str, ...]     # Sub.__init__ lines (modules only)
    sub_body: tuple[str, ...]     # Sub.forward statements, ``x`` in, ``y`` out
    init: tuple[str, ...]         # Model.__init__ lines
    body: tuple[str, ...]         # statements of the forward / function
    returns: tuple[str, ...]      # returned items
    structure: str                # "single", "tuple", "list", "dict", "nested"
    steps: tuple[Call | Change, ...] = field(default=())

    def with_(self, **changes) -> "Program":
        return replace(self, **changes)

    @property
    def source(self) -> str:
        parts = [PRELUDE]
        parts += [h + "\n" for h in self.header]
        body = _block(self.body) + [f"return {self.return_expression()}"]
        signature = ", ".join(self.params)
        if self.kind == "function":
            parts.append(f"def f({signature}):\n" + _indent(body, 1))
        else:
            sub_body = _block(self.sub_body) + ["return y"]
            if self.sub_init or self.sub_body:
                parts.append("class Sub(nn.Module):\n"
                             "    def __init__(self):\n        super().__init__()\n"
                             + _indent(self.sub_init, 2) + "\n"
                             "    def forward(self, x):\n        y = x\n" + _indent(sub_body, 2))
            parts.append("class Model(nn.Module):\n"
                         "    def __init__(self):\n        super().__init__()\n"
                         + _indent(self.init, 2) + "\n"
                         f"    def forward(self, {signature}):\n" + _indent(body, 2))
        return "\n".join(parts)

    def return_expression(self) -> str:
        items = list(self.returns)
        if not items:
            return "None"
        if self.structure == "single" or (self.structure == "nested" and len(items) < 3):
            return items[0] if len(items) == 1 else "(" + ", ".join(items) + ",)"
        if self.structure == "tuple":
            return "(" + ", ".join(items) + ",)"
        if self.structure == "list":
            return "[" + ", ".join(items) + "]"
        if self.structure == "dict":
            return "{" + ", ".join(f"'k{i}': {e}" for i, e in enumerate(items)) + "}"
        head, *rest = items
        inner = ", ".join(f"'k{i}': {e}" for i, e in enumerate(rest[:-1]))
        return f"({head}, {{{inner}, 'tail': [{rest[-1]}, None]}})"

    def reproducer(self, outcome: str = "") -> str:
        """A runnable script: the program, then each step, then ``replay`` comparing with eager."""
        steps = ",\n".join(f"    {s!r}" for s in self.steps)
        comment = "\n".join(f"# {line}" for line in outcome.splitlines())
        listing = "\n".join(f"# --- step {i}: {type(s).__name__.lower()}\n"
                            + textwrap.indent(s.render(), "# ")
                            for i, s in enumerate(self.steps))
        return (f"# keraunos fuzz reproducer, program {self.name}\n{comment}\n"
                f"# The program (the same source is in PROGRAM below):\n"
                + textwrap.indent(self.source, "#   ") + "\n" + listing + "\n"
                "from keraunos.testing.fuzz import Call, Change, Program, replay\n\n"
                f"program = Program(name={self.name!r}, kind={self.kind!r}, params={self.params!r},\n"
                f"    header={self.header!r},\n    sub_init={self.sub_init!r},\n"
                f"    sub_body={self.sub_body!r},\n    init={self.init!r},\n"
                f"    body={self.body!r},\n    returns={self.returns!r}, structure={self.structure!r},\n"
                f"    steps=(\n{steps},\n    ))\nprint(replay(program))\n")


def _block(statements) -> list[str]:
    return [line for s in statements for line in s.splitlines()]


def _indent(lines, level: int) -> str:
    pad = "    " * level
    return "\n".join(pad + line for line in lines) + "\n" if lines else pad + "pass\n"
