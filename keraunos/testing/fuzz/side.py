"""One side of a fuzzed program, the jitted one or its eager twin: its globals and model, one
call, one backward; and what happened to a program (``Outcome``). The driver (drive.py) runs two
sides and compares them; the classifier (classify.py) runs sides again to judge a mismatch."""
from __future__ import annotations

import contextlib
import hashlib
import sys
import types
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from .program import Call, Program

# "rounding": a float mismatch the classifier (classify.py) found to be float32 rounding of an
# ill-conditioned program, not a wrong result: reported apart, not a failure.
STATUSES = ("pass", "mismatch", "rounding", "internal error", "refusal")

# ``--autocast``: what makes the context both sides run every step in (calls, changes of state,
# backwards) and the float32 reruns that classify a mismatch, never their float64 run; None: none.
AMBIENT: Callable[[], ContextManager] | None = None


def ambient() -> ContextManager:
    """A fresh ``AMBIENT`` context (a null one without it)."""
    return AMBIENT() if AMBIENT is not None else contextlib.nullcontext()


@dataclass
class Outcome:
    """What happened to one program: ``status`` is one of ``STATUSES``; ``check`` says which
    comparison failed, the refusal's cause, or the exception; ``step`` is where."""

    status: str
    check: str = ""
    detail: str = ""
    step: int = -1
    calls: int = 0              # calls compared before the program ended
    ended_by_error: str = ""    # both sides raised the same exception (the program is invalid)

    @property
    def signature(self) -> tuple[str, str]:
        return self.status, self.check

    def __str__(self) -> str:
        where = f" at step {self.step}" if self.step >= 0 else ""
        text = f"{self.status}{where}: {self.check}" if self.check else self.status
        return text + (f"\n{self.detail}" if self.detail else "")


class Side:
    def __init__(self, program: Program, filename: str, make_jitted: Callable | None):
        # The program's globals are a module's, found in ``sys.modules`` under a name made from
        # its source: its classes and functions can then be named (the program store keeps a
        # jitted module's program only where they can, and a later run of the same programs
        # loads it).
        digest = hashlib.sha256(program.source.encode()).hexdigest()[:16]
        name = f"keraunos_fuzz_program_{digest}_{'jit' if make_jitted else 'eager'}"
        module = types.ModuleType(name)
        module.__file__ = filename
        sys.modules[name] = module
        self.ns: dict = vars(module)
        exec(compile(program.source, filename, "exec"), self.ns)
        torch.manual_seed(0)
        plain = self.ns["Model"]() if program.kind == "module" else self.ns["f"]
        self.model = plain if program.kind == "module" else None
        self.target = make_jitted(plain) if make_jitted else plain

    def env(self) -> dict:
        return dict(self.ns, model=self.model, target=self.target, G=self.ns)


def call_one(step: Call, side: Side):
    """One call on one side: its output and the tensors it names (arguments and the tensors its
    set-up made), in the order they are compared."""
    env = side.env()
    before = set(env)
    torch.manual_seed(step.seed)
    exec(step.full_source, env)
    torch.manual_seed(step.seed)
    with torch.set_grad_enabled(not step.no_grad):
        out = side.target(*env["args"], **env["kwargs"])
    named = {k: v for k, v in env.items() if k not in before and isinstance(v, torch.Tensor)}
    for i, a in enumerate(env["args"]):
        named.setdefault(f"args[{i}]", a)
    for k, a in env["kwargs"].items():
        named.setdefault(f"kwargs[{k!r}]", a)
    return out, [(k, v) for k, v in named.items() if isinstance(v, torch.Tensor)]


def globals_of(side: Side) -> dict:
    return {k: v for k, v in side.ns.items()
            if k.isupper() and isinstance(v, (int, float, torch.Tensor))}


def grad_outputs(flat) -> list[torch.Tensor]:
    return [v for _, v in flat if isinstance(v, torch.Tensor) and v.requires_grad
            and v.is_floating_point()]


def backward_one(flat) -> int:
    """The backward of one side: of the sum of its floating outputs that require grad."""
    outputs = grad_outputs(flat)
    if outputs:
        sum(t.sum() for t in outputs).backward()
    return len(outputs)
