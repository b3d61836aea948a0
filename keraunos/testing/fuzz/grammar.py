"""The statement grammar of fuzzed programs: typed tensor expressions and statements.

Every tensor value has a *kind*, its shape in terms of a batch size ``N`` (which changes between
calls) and the fixed feature size ``D`` (parameters are sized by it):

    ND: (N, D)   D: (D,)   N: (N,)   N1: (N, 1)   S: ()   M: a bool (N, D) mask

Expressions of a kind are built only from kinds that broadcast into it, so generated programs run
(eagerly) for every N. Expressions marked ``exact`` keep the inputs' dtype (no float64 mixes), for
the operands of matmul/einsum/linear, which refuse mixed dtypes.
"""
from __future__ import annotations

import random


FITS = {"ND": ("ND", "ND", "D", "N1", "S"), "D": ("D", "D", "S"), "N": ("N", "N", "S"),
        "N1": ("N1", "N1", "S"), "S": ("S",)}
KIND_WEIGHTS = (("ND", 6), ("D", 2), ("N", 1), ("N1", 1), ("S", 2))

UNARY = ("torch.sin({})", "({}).tanh()", "F.relu({})", "torch.sigmoid({})", "({}).abs()",
         "-({})", "({}).clamp(-2.0, 2.0).exp()", "F.gelu({})", "({}).pow(2)", "({}).square()",
         "({}) * 0.5", "({}) + 1.0", "torch.log1p(({}).abs())", "({}).clamp(min=-0.5)")
UNARY_DIM = ("torch.softmax({}, dim=-1)", "({}).cumsum(0)", "({}).flip(0)")
BINARY = ("({}) + ({})", "({}) - ({})", "({}) * ({})", "torch.maximum({}, {})",
          "({}) / (({}).abs() + 1.0)", "torch.where(({}) > 0, {}, -0.5)")
INPLACE_SELF = ("{t}.sigmoid_()", "{t}.relu_()", "{t}.tanh_()", "{t}.abs_()", "{t}.neg_()",
                "{t}.clamp_(-1.0, 1.0)", "{t}.clamp_(min=0.0)", "{t}.pow_(2)",
                "{t}.clamp_(-3.0, 3.0).exp_()", "{t}.mul_(2.0)", "{t}.add_(1.0)")
INPLACE_VIEW = ("{t}.t().mul_(2.0)", "{t}.unsqueeze(0).sigmoid_()", "{t}[:, 1:3].clamp_(-0.5, 0.5)",
                "{t}[::2].add_(1.0)", "{t}[0].mul_(-1.0)", "{t}[-1] = 0.0", "{t}[:, 0] = 1.0",
                "{t}.unsqueeze(0).tanh_()", "{t}[{t} > 0] = 0.0", "{t}.diagonal().zero_()")

# In-place metadata changes (t_, transpose_, unsqueeze_) of a value, a write through a view of
# it while it is changed, and the change undone: the kind (its shape) is the same afterwards.
METADATA_ROUND_TRIP = {
    "ND": ("{t}.t_(); {t}[..., :1].neg_(); {t}.t_()",
           "{t}.transpose_(0, 1); {t}[0].mul_(2.0); {t}.transpose_(0, 1)",
           "{t}.t_(); {t}[1:].clamp_(-0.5, 0.5); {t}.t_()",
           "{t}.unsqueeze_(0); {t}[:, 0].add_(1.0); {t}.squeeze_(0)",
           "{t}.t_(); {t}.masked_fill_({t} > 0, 0.5); {t}.t_()"),
    "D": ("{t}.unsqueeze_(0); {t}[0, :1].neg_(); {t}.squeeze_(0)",
          "{t}.unsqueeze_(1); {t}[1:].mul_(0.5); {t}.squeeze_(1)"),
}


class _Body:
    """Generates the statements of one function body, tracking the names of each kind."""

    def __init__(self, rng: random.Random, owner, names: dict[str, list[str]],
                 prefix: str):
        self.rng = rng
        self.owner = owner
        self.names = names          # kind -> names of values of that kind in scope
        self.prefix = prefix
        self.inputs: set[str] = set()
        self.mutated: set[str] = set()
        self.view_of: dict[str, str] = {}
        self.statements: list[str] = []
        self.count = 0

    # ------------------------------------------------------------------ expressions
    def atom(self, kind: str) -> str:
        names = self.names.get(kind, [])
        if names and self.rng.random() < 0.85:
            return self.rng.choice(names)
        base = self.rng.choice(self.names["ND"])
        return {"ND": base, "D": f"{base}.mean(0)", "N": f"{base}.sum(-1)",
                "N1": f"{base}.mean(-1, keepdim=True)", "S": f"{base}.sum()"}[kind]

    def expr(self, kind: str, depth: int = 2, exact: bool = False) -> str:
        rng = self.rng
        if depth <= 0 or rng.random() < 0.2:
            return self.atom(kind)
        makers = [self.unary, self.binary, self.binary, self.scalar_op, self.reduce]
        if kind == "ND":
            makers += [self.matmul, self.matmul] + self.owner.nd_makers(self)
        if kind in ("N", "S", "D"):
            makers.append(self.matmul)
        if "M" in self.names and kind == "ND":
            makers.append(self.masked)
        if not exact:
            makers += [self.dtype_mix]
        if self.owner.helpers_for(kind):
            makers.append(self.helper_call)
        return rng.choice(makers)(kind, depth - 1, exact)

    def sub(self, kind: str, depth: int, exact: bool) -> str:
        return self.expr(self.rng.choice(FITS[kind]), depth, exact)

    def unary(self, kind, depth, exact):
        forms = UNARY + (UNARY_DIM if kind != "S" else ())
        if self.owner.kind == "module" and self.rng.random() < 0.1:
            return f"F.dropout({self.expr(kind, depth, exact)}, p=0.5, training=self.training)"
        return self.rng.choice(forms).format(self.expr(kind, depth, exact))

    def binary(self, kind, depth, exact):
        a, b = self.expr(kind, depth, exact), self.sub(kind, depth, exact)
        if self.rng.random() < 0.5:
            a, b = b, a
        return self.rng.choice(BINARY).format(a, b)

    def scalar_op(self, kind, depth, exact):
        op = self.rng.choice(("*", "+", "-"))
        return f"({self.expr(kind, depth, exact)}) {op} {self.owner.scalar(self)}"

    def reduce(self, kind, depth, exact):
        x = self.expr("ND", depth, exact)
        forms = {"D": ("({}).sum(0)", "({}).mean(0)", "({}).amax(0)", "({}).std(0)"),
                 "N": ("({}).sum(-1)", "({}).mean(1)", "({}).norm(dim=-1)", "({}).logsumexp(-1)"),
                 "N1": ("({}).mean(-1, keepdim=True)", "({}).amax(-1, keepdim=True)",
                        "({}).sum(1).unsqueeze(-1)"),
                 "S": ("({}).sum()", "({}).mean()", "({}).amax()", "({}).norm()"),
                 "ND": ("({}) - ({{}}).mean(-1, keepdim=True)", "({}) * ({{}}).sum(0)")}
        form = self.rng.choice(forms[kind])
        return form.format(x).format(self.expr("ND", depth, exact)) if kind == "ND" else form.format(x)

    def matmul(self, kind, depth, exact):
        x, y = self.expr("ND", depth, True), self.expr("ND", depth, True)
        if kind == "ND":
            z = self.expr("ND", depth, True)
            return self.rng.choice((f"({x}) @ ({y}).t() @ ({z})",
                                    f"torch.einsum('nd,md,me->ne', {x}, {y}, {z})",
                                    f"torch.bmm(({x}).unsqueeze(0), ({y}).t().unsqueeze(0) @ ({z}).unsqueeze(0))[0]"))
        if kind == "N":
            return self.rng.choice((f"torch.einsum('...i,...i->...', {x}, {y})",
                                    f"torch.einsum('nd,nd->n', {x}, {y})", f"(({x}) * ({y})).sum(-1)"))
        if kind == "D":
            d = self.expr("D", depth, True)
            return self.rng.choice((f"({x}).t() @ (({y}) @ {d})", f"torch.einsum('nd,n->d', {x}, ({y}) @ {d})"))
        d1, d2 = self.expr("D", depth, True), self.expr("D", depth, True)
        return self.rng.choice((f"torch.dot({d1}, {d2})", f"torch.einsum('nd,nd->', {x}, {y})"))

    def masked(self, kind, depth, exact):
        m = self.rng.choice(self.names["M"])
        x, y = self.expr("ND", depth, exact), self.sub("ND", depth, exact)
        return self.rng.choice((f"({x}).masked_fill({m}, 0.0)", f"torch.where({m}, {x}, {y})",
                                f"({x}) * {m}"))

    def dtype_mix(self, kind, depth, exact):
        x, y = self.expr(kind, depth, exact), self.sub(kind, depth, exact)
        return self.rng.choice((f"({x}).double()", f"({x}) + (({y}) > 0)",
                                f"({x}) * ({y}).to(torch.float64)", f"({x}).to(torch.bfloat16).float()",
                                f"({x}) + ({y}).long()", f"({x}).half().to(({y}).dtype)"))

    def helper_call(self, kind, depth, exact):
        return f"{self.rng.choice(self.owner.helpers_for(kind))}({self.expr(kind, depth, exact)})"

    # ------------------------------------------------------------------- statements
    def fresh(self, kind: str) -> str:
        self.count += 1
        return f"{self.prefix}{self.count}"

    def define(self, name: str, kind: str) -> None:
        self.names.setdefault(kind, []).append(name)

    def assign(self) -> None:
        kind = _weighted(self.rng, KIND_WEIGHTS)
        name = self.fresh(kind)
        value = self.expr(kind, self.rng.choice((1, 2, 2, 3)))
        if value in self.names.get(kind, []):  # a second name for the same tensor
            self.view_of[name] = self.view_of.get(value, value)
        if self.rng.random() < 0.1:
            value = f"({value}).detach()"
        self.statements.append(f"{name} = {value}")
        self.define(name, kind)

    def branch(self) -> None:
        kind = _weighted(self.rng, KIND_WEIGHTS)
        name = self.fresh(kind)
        cond = self.owner.condition(self)
        self.statements.append(f"if {cond}:\n    {name} = {self.expr(kind)}\n"
                               f"else:\n    {name} = {self.expr(kind)}")
        self.define(name, kind)

    def loop(self) -> None:
        kind = self.rng.choice(("ND", "D"))
        target = self.rng.choice(self.names.get(kind) or [self.atom(kind)])
        name = self.fresh(kind)
        base = self.rng.choice(self.names["ND"])
        step = (f"{name} = {name} * 0.5 + {self.sub(kind, 1, False)}" if kind == "ND"
                else f"{name} = {name} + {base}[i]")
        self.statements.append(f"{name} = {target}\nfor i in range(min({base}.shape[0], 3)):\n    {step}")
        self.define(name, kind)

    def no_grad_block(self) -> None:
        kind = _weighted(self.rng, KIND_WEIGHTS)
        name = self.fresh(kind)
        self.statements.append(f"with torch.no_grad():\n    {name} = {self.expr(kind)}")
        self.define(name, kind)

    def view(self) -> None:
        base = self.rng.choice([n for n in self.names["ND"] if n in self.inputs] or self.names["ND"])
        kind, form = self.rng.choice((("ND", "{}[:]"), ("ND", "{}.view({}.shape)"),
                                      ("ND", "{}.unsqueeze(0).squeeze(0)"), ("D", "{}[0]"),
                                      ("D", "{}[-1]"), ("D", "{}.select(0, 1)"), ("N", "{}[:, 0]"),
                                      ("ND", "{}.expand_as({})")))
        name = self.fresh(kind)
        self.statements.append(f"{name} = {form.format(base, base)}")
        self.view_of[name] = self.view_of.get(base, base)
        self.define(name, kind)

    def inplace(self, targets: list[str] | None = None) -> None:
        rng = self.rng
        # Parameters and buffers are written only by the module's own statements (under no_grad):
        # an in-place write to a parameter is an eager error, and one to a buffer with a value that
        # requires grad chains every later call's graph to the first.
        candidates = targets or [n for k in ("ND", "D") for n in self.names.get(k, [])
                                 if not self.view_of.get(n, n).startswith("self.")]
        if not candidates:
            return
        t = rng.choice(candidates)
        kind = "ND" if t in self.names["ND"] else "D"
        r = rng.random()
        if r < 0.35:
            value = self.sub(kind, 1, False)
            form = rng.choice(("{t}.add_({v})", "{t}.mul_({v})", "{t}.copy_({v})", "{t}.sub_({v})",
                               "{t}.addcmul_({v}, {v}, value=0.5)", "{t}.lerp_({v}, 0.3)"))
            stmt = form.format(t=t, v=value)
        elif r < 0.45:
            stmt = rng.choice(METADATA_ROUND_TRIP[kind]).format(t=t)
        elif r < 0.6 or kind == "D":
            stmt = rng.choice(INPLACE_SELF).format(t=t)
        elif r < 0.8:
            stmt = rng.choice(INPLACE_VIEW).format(t=t)
        else:
            stmt = rng.choice((f"{t}[0] = {self.expr('D', 1)}",
                               f"{t}.index_put_((torch.tensor([0, 1]),), ({self.expr('D', 1)}).to({t}.dtype))",
                               f"{t}.index_put_((torch.tensor([1, 1]),), ({self.expr('D', 1)}).to({t}.dtype), accumulate=True)",
                               f"{t}[1:] = {self.sub('D', 1, False)}",
                               f"{t}.masked_fill_(({self.expr('ND', 1)}) > 0.5, 0.0)")
                              + ((f"{t}[{self.names['M'][0]}] = 1.5",
                                  f"{t}.masked_scatter_({self.names['M'][0]}, ({self.expr('ND', 1)}).to({t}.dtype))")
                                 if "M" in self.names else ()))
        self.statements.append(stmt)
        self.mutated.add(self.view_of.get(t, t))

    def statement(self) -> None:
        rng = self.rng
        makers = ((self.assign, 10), (self.branch, 2), (self.loop, 1), (self.no_grad_block, 1),
                  (self.view, 2), (self.inplace, 3)) + self.owner.module_statements(self)
        _weighted(rng, makers)()


def _weighted(rng: random.Random, pairs):
    total = sum(w for _, w in pairs)
    x = rng.uniform(0, total)
    for value, w in pairs:
        x -= w
        if x <= 0:
            return value
    return pairs[-1][0]
