"""Programs from a seed: ``generate(name)`` returns a ``Program`` (source pieces and steps).

The body grammar is in ``grammar.py``; this file decides what surrounds it (function or module,
parameters, buffers, submodule, plain attributes, globals read by helpers), what is returned,
and the sequence of calls and state changes that drives the program.
"""
from __future__ import annotations

import random

from .grammar import KIND_WEIGHTS, _Body, _weighted
from .program import Call, Change, Program

HELPERS = {  # name -> (source, kinds it accepts, globals it reads)
    "scale": ("def scale(t):\n    return t * SCALE + BIAS", ("ND", "D", "N", "N1", "S")),
    "squash": ("def squash(t):\n    if SCALE > 1.0:\n        return torch.tanh(t) * SCALE\n"
               "    return t - BIAS", ("ND", "D", "N", "N1", "S")),
    "shift": ("def shift(t):\n    return t + OFFSET", ("ND", "D")),
    "twice": ("def twice(t):\n    return scale(t) + scale(t * 0.5)", ("ND", "D", "N", "N1", "S")),
}
GLOBALS = "SCALE = 1.5\nBIAS = 0.25\nOFFSET = torch.linspace(-1.0, 1.0, D)"
MEMBERS = {  # name -> Model.__init__ line
    "W": "self.W = nn.Parameter(torch.randn(D, D) * 0.5)",
    "w": "self.w = nn.Parameter(torch.randn(D))",
    "buf": "self.register_buffer('buf', torch.zeros(D))",
    "count": "self.register_buffer('count', torch.zeros((), dtype=torch.int64))",
    "sub": "self.sub = Sub()",
    "lin": "self.lin = nn.Linear(D, D)",
    "alpha": "self.alpha = 0.5",
    "flag": "self.flag = True",
    "calls": "self.calls = 0",
}
BATCH_NORM = "self.bn = nn.BatchNorm1d(D)"  # a member of some modules' (``generate``)
SUB_INIT = ("self.v = nn.Parameter(torch.randn(D) * 0.5)",
            "self.register_buffer('stat', torch.ones(D))", "self.gain = 1.0")


class _Scope:
    """What a body may use besides its own values: members, helpers, the scalar argument."""

    def __init__(self, kind: str, members: set[str], helpers: list[str], has_s: bool):
        self.kind = kind
        self.members = members
        self.helpers = helpers
        self.has_s = has_s

    def helpers_for(self, kind: str) -> list[str]:
        return [h for h in self.helpers if kind in HELPERS[h][1]]

    def nd_makers(self, body: _Body) -> list:
        makers = []
        if "W" in self.members:
            makers.append(lambda k, d, e: body.rng.choice(
                ("({}) @ self.W", "F.linear({}, self.W)", "torch.einsum('nd,de->ne', {}, self.W)"))
                .format(body.expr("ND", d, True)))
        if "sub" in self.members:
            makers.append(lambda k, d, e: f"self.sub({body.expr('ND', d, True)})")
        if "lin" in self.members:
            makers.append(lambda k, d, e: f"self.lin({body.expr('ND', d, True)})")
        if "bn" in self.members:  # batch statistics in training, written to buffers in place
            makers.append(lambda k, d, e: f"self.bn({body.expr('ND', d, True)})")
        return makers

    def scalar(self, body: _Body) -> str:
        options = ["0.5", "2.0", "-1.5", "3", f"{body.rng.choice(body.names['ND'])}.shape[0]"]
        if self.has_s:
            options += ["s", "s"]
        if "alpha" in self.members:
            options += ["self.alpha", "self.alpha"]
        if "gain" in self.members:
            options += ["self.gain"]
        if self.kind == "function":
            options += ["SCALE"]
        return body.rng.choice(options)

    def condition(self, body: _Body) -> str:
        a = body.rng.choice(body.names["ND"])
        options = [f"{a}.shape[0] > 2", f"{a}.shape[0] % 2 == 0", f"{a}.is_contiguous()",
                   f"{a}.dtype == torch.float64", f"{a}.requires_grad", "torch.is_grad_enabled()",
                   f"{a}.stride(-1) == 1"]
        if self.has_s:
            options += ["s > 0", "isinstance(s, float)", "s == 0"]
        if self.kind == "module":
            options += ["self.training", "self.training"]
        for member, cond in (("flag", "self.flag"), ("calls", "self.calls % 2 == 0"),
                             ("alpha", "self.alpha > 0.4")):
            if member in self.members:
                options.append(cond)
        if self.kind == "function" or self.helpers:
            options.append("SCALE > 1.0")
        return body.rng.choice(options)

    def module_statements(self, body: _Body) -> tuple:
        statements = []
        if "buf" in self.members:
            statements.append((lambda: body.statements.append(
                f"with torch.no_grad():\n    self.buf.mul_(0.9).add_(({body.expr('D', 1)}) * 0.1)"), 1))
        if "stat" in self.members:
            statements.append((lambda: body.statements.append(
                "with torch.no_grad():\n    self.stat.mul_(0.99)"), 1))
        if "count" in self.members:
            statements.append((lambda: body.statements.append("self.count.add_(1)"), 1))
        if "calls" in self.members:
            statements.append((lambda: body.statements.append("self.calls = self.calls + 1"), 1))
        return tuple(statements)


def generate(name: str) -> Program:
    """The program called ``name`` (``"<seed>:<index>"``); the same name gives the same program."""
    rng = random.Random(name)
    kind = "module" if rng.random() < 0.6 else "function"
    tensor_params = ["a"] + [rng.choice(("b", "b", "d", "m")) for _ in range(rng.choice((0, 1, 1, 2)))]
    tensor_params = [p if p not in tensor_params[:i] else p + str(i)
                     for i, p in enumerate(tensor_params)]
    has_s = rng.random() < 0.5
    params = tuple(tensor_params + (["s"] if has_s else []))
    helpers = [h for h in HELPERS if rng.random() < 0.3]
    if "twice" in helpers and "scale" not in helpers:
        helpers.insert(0, "scale")
    members = ({m for m in MEMBERS if rng.random() < 0.55} if kind == "module" else set())
    if kind == "module" and random.Random(f"{name}/bn").random() < 0.25:
        members.add("bn")  # drawn apart: the programs without it are the same as before
    scope = _Scope(kind, members, helpers, has_s)

    names = {"ND": [p for p in tensor_params if p[0] in "abc"],
             "D": [p for p in tensor_params if p[0] == "d"]}
    masks = [p for p in tensor_params if p[0] == "m"]
    if masks:
        names["M"] = masks
    names["D"] += [f"self.{m}" for m in ("w", "buf") if m in members]
    body = _Body(rng, scope, names, "t")
    body.inputs = {p for p in tensor_params if p[0] != "m"}
    if rng.random() < 0.5:
        for _ in range(rng.choice((1, 1, 2))):
            body.inplace([p for p in tensor_params if p[0] in "abcd"])
    for _ in range(rng.randint(1, 6)):
        body.statement()
    if rng.random() < 0.2:
        body.inplace([p for p in tensor_params if p[0] in "abcd"])
    returns = _returns(rng, body, scope, tensor_params)
    header = (GLOBALS,) + tuple(HELPERS[h][0] for h in helpers) if (helpers or kind == "function") else ()
    sub_init, sub_body = _sub(rng, helpers) if "sub" in members else ((), ())
    program = Program(
        name=name, kind=kind, params=params, header=header, sub_init=sub_init, sub_body=sub_body,
        init=tuple(MEMBERS[m] for m in MEMBERS if m in members) + (
            (BATCH_NORM,) if "bn" in members else ()), body=tuple(body.statements),
        returns=tuple(returns), structure=rng.choice(("single", "tuple", "tuple", "list", "dict", "nested")))
    return program.with_(steps=tuple(_Steps(rng, program, members, body.mutated, helpers).make()))


def _sub(rng: random.Random, helpers: list[str]):
    scope = _Scope("module", {"v", "stat", "gain"}, helpers, False)
    body = _Body(rng, scope, {"ND": ["x", "y"], "D": ["self.v", "self.stat"]}, "u")
    for _ in range(rng.randint(0, 2)):
        _weighted(rng, ((body.assign, 3), (body.branch, 1)) + scope.module_statements(body))()
    body.statements.append(f"y = {body.expr('ND', 2, True)} * self.gain")
    if rng.random() < 0.6:
        body.statements.append("if self.training:\n    y = y * 0.9\nelse:\n    y = y - self.stat * 0.1")
    return SUB_INIT, tuple(body.statements)


def _returns(rng: random.Random, body: _Body, scope: _Scope, tensor_params: list[str]) -> list[str]:
    values = [n for k in KIND_WEIGHTS for n in body.names.get(k[0], []) if not n.startswith("self.")]
    inputs = [p for p in tensor_params]
    a = rng.choice([p for p in tensor_params if p[0] in "abc"])
    options = [
        (lambda: rng.choice(values), 8),
        (lambda: rng.choice(inputs), 2),
        (lambda: rng.choice((f"{a}[1:]", f"{a}.t()", f"{a}.reshape(-1)", f"{a}.unsqueeze(0)",
                             f"{a}[:, 0]", f"{a}.detach()", f"{a}.transpose(0, 1)[::2]",
                             f"{a}.view(-1)")), 2),
        (lambda: f"{rng.choice(values)}.clone()", 1),
        (lambda: rng.choice(("None", "3", "0.5", f"{a}.shape", f"{a}.dtype", f"{a}.shape[0]",
                             "torch.float32", f"{a}.shape[0] * 2")), 2),
    ]
    if scope.has_s:
        options.append((lambda: rng.choice(("s", "s * 2")), 1))
    members = scope.members
    for m in ("w", "buf", "calls", "count"):
        if m in members:
            options.append((lambda m=m: f"self.{m}", 1))
    returns = [_weighted(rng, options)() for _ in range(rng.choice((1, 1, 2, 2, 3, 4)))]
    if rng.random() < 0.15:
        returns.append(rng.choice(returns))  # the same object twice
    return returns


class _Steps:
    """The calls and state changes; a call spec changes a little between calls so that some
    calls hit the cache and others miss it for one reason."""

    def __init__(self, rng, program: Program, members: set[str], mutated: set[str], helpers):
        self.rng = rng
        self.program = program
        self.members = members
        self.mutated = mutated
        self.helpers = helpers
        self.dtype = "torch.float32"
        self.seed = rng.randrange(10**6)
        tensors = [p for p in program.params if p != "s"]
        self.spec = dict(n=3, dtype="torch.float32", grad={p: rng.random() < 0.5 for p in tensors},
                         layout={p: "fresh" for p in tensors}, alias=None, s=0.5, kw=False)

    def make(self) -> list:
        steps = []
        for i in range(self.rng.randint(3, 7)):
            if i:
                for _ in range(self.rng.choice((0, 0, 1, 1, 2))):
                    change = self.change()
                    if change:
                        steps.append(Change(change, self.next_seed()))
                self.mutate_spec()
            no_grad = i > 0 and self.rng.random() < 0.2
            source, args, kwargs = self.render_call()
            steps.append(Call(source, self.next_seed(), args, kwargs, no_grad))
        return steps

    def next_seed(self) -> int:
        self.seed += 1
        return self.seed

    def mutate_spec(self) -> None:
        rng, spec = self.rng, self.spec
        tensors = list(spec["layout"])
        if rng.random() < 0.35:
            return  # the same metadata, new values: a cache hit
        what = rng.choice(("n", "n", "dtype", "grad", "layout", "layout", "alias", "s", "kw"))
        if what == "n":
            spec["n"] = rng.choice((2, 3, 4, 5))
        elif what == "dtype" and self.program.kind == "function":
            spec["dtype"] = rng.choice(("torch.float32", "torch.float64"))
        elif what == "grad":
            p = rng.choice(tensors)
            spec["grad"][p] = not spec["grad"][p]
        elif what == "layout":
            spec["layout"][rng.choice(tensors)] = rng.choice(
                ("fresh", "transposed", "strided", "sliced", "expanded", "param"))
        elif what == "alias":
            spec["alias"] = rng.choice((None, "same", "overlap", "disjoint", "transpose", "row"))
        elif what == "s":
            spec["s"] = rng.choice((0.5, -1.5, 2, 0, 0.0, -0.0, 3, 1.0, True))
        elif what == "kw":
            spec["kw"] = not spec["kw"]

    def render_call(self) -> tuple[str, tuple, tuple]:
        spec = self.spec
        dtype = self.dtype if self.program.kind == "module" else spec["dtype"]
        lines, args = [], {}
        pair = [p for p in spec["layout"] if p[0] in "abc"][:2]
        if spec["alias"] and len(pair) == 2:
            args.update(self.aliased(lines, pair, spec["alias"], spec["n"], dtype))
        for p in spec["layout"]:
            if p not in args and not (p == "d" and spec["alias"] == "row"):
                args[p] = self.tensor(lines, p, spec["n"], dtype)
        if "d" in spec["layout"] and "d" not in args:  # a row of another argument
            a = args.get("a", "")
            args["d"] = f"{a}[0]" if not a.startswith("L_") else self.tensor(lines, "d", spec["n"], dtype)
        ordered = [args[p] for p in self.program.params if p != "s"]
        kwargs = ()
        if "s" in self.program.params:
            if spec["kw"]:
                kwargs = (("s", repr(spec["s"])),)
            else:
                ordered.append(repr(spec["s"]))
        return "\n".join(lines), tuple(ordered), kwargs

    def leaf(self, lines, name, shape, dtype, grad, mutated, kind="randn") -> str:
        """A tensor of ``shape``; when it requires grad, a leaf and (if the program writes to
        it) a non-leaf copy, since eager refuses in-place writes to leaves that require grad."""
        make = (f"torch.rand({shape}) > 0.5" if kind == "mask"
                else f"torch.randn({shape}, dtype={dtype})")
        if not grad or kind == "mask":
            lines.append(f"{name} = {make}")
            return name
        lines.append(f"L_{name} = ({make}).requires_grad_()")
        if mutated or self.rng.random() < 0.3:
            lines.append(f"{name} = L_{name}.clone()")
            return name
        return f"L_{name}"

    def tensor(self, lines, p, n, dtype) -> str:
        spec = self.spec
        grad, mutated = spec["grad"][p], p in self.mutated
        layout = spec["layout"][p]
        if p[0] == "m":
            base = self.leaf(lines, f"{p}_base", f"{n}, D" if layout != "transposed" else f"D, {n}",
                             dtype, False, False, "mask")
            return f"{base}.t()" if layout == "transposed" else base
        if p[0] == "d":
            if layout == "param" and self.program.kind == "module" and {"buf", "w"} & self.members:
                member = "buf" if "buf" in self.members else "w"
                return f"model.{member}.detach()[:]" if member == "w" else f"model.{member}[:]"
            if layout in ("strided", "transposed"):
                return f"{self.leaf(lines, p + '_base', '2 * D', dtype, grad, mutated)}[::2]"
            return self.leaf(lines, p + "_base", "D", dtype, grad, mutated)
        if layout == "transposed":
            return f"{self.leaf(lines, p + '_base', f'D, {n}', dtype, grad, mutated)}.t()"
        if layout == "strided":
            return f"{self.leaf(lines, p + '_base', f'{n}, 2 * D', dtype, grad, mutated)}[:, ::2]"
        if layout == "sliced":
            return f"{self.leaf(lines, p + '_base', f'{n} + 2, D', dtype, grad, mutated)}[1:-1]"
        if layout == "expanded" and not mutated:
            return f"{self.leaf(lines, p + '_base', 'D', dtype, grad, mutated)}.expand({n}, D)"
        return self.leaf(lines, p + "_base", f"{n}, D", dtype, grad, mutated)

    def aliased(self, lines, pair, how, n, dtype) -> dict:
        x, y = pair
        grad = self.spec["grad"][x] or self.spec["grad"][y]
        writes = bool(self.mutated & {x, y})
        if how == "same":
            base = self.leaf(lines, "shared", f"{n}, D", dtype, grad, writes)
            return {x: base, y: base}
        if how == "overlap":
            base = self.leaf(lines, "shared", f"{n} + 1, D", dtype, grad, writes)
            return {x: f"{base}[:-1]", y: f"{base}[1:]"}
        if how == "disjoint":
            base = self.leaf(lines, "shared", f"{n}, 2 * D", dtype, grad, writes)
            return {x: f"{base}[:, :D]", y: f"{base}[:, D:]"}
        if how == "transpose":
            self.spec["n"] = 4
            base = self.leaf(lines, "shared", "D, D", dtype, grad, writes)
            return {x: base, y: f"{base}.t()"}
        return {}

    # ---------------------------------------------------------------- state changes
    def change(self) -> str | None:
        rng, members = self.rng, self.members
        options = []
        if self.helpers or self.program.kind == "function":
            options += ["G['SCALE'] = 0.75", "G['SCALE'] = 2.5", "G['BIAS'] = -1.0",
                        "G['OFFSET'] = torch.randn(D)", "G['OFFSET'].mul_(2.0)"]
        if self.program.kind == "module":
            options += ["model.train(False)", "model.train()", "target.eval()", "target.train()"]
            options += ["model.zero_grad()"]
            if self.dtype == "torch.float32":
                options.append("model.double()")
            else:
                options.append("model.float()")
            if {"W", "w", "sub", "lin", "bn"} & members:
                options += ["torch.optim.SGD(model.parameters(), lr=0.1).step()"] * 2
            options.append("model.load_state_dict({k: v * 0.5 + 0.25 if v.is_floating_point() else v + 1"
                           " for k, v in model.state_dict().items()})")
        to_dtype = "" if self.dtype == "torch.float32" else ".double()"
        for member, changes in (
            ("alpha", ["model.alpha = -0.5", "model.alpha = 2.0", "model.alpha = 1", "target.alpha = 0.7"]),
            ("flag", ["model.flag = not model.flag"]),
            ("calls", ["model.calls = 7"]),
            ("w", ["model.w = nn.Parameter(torch.randn(D))" + to_dtype,
                   "model.w.data = torch.randn(D)" + to_dtype, "model.w.requires_grad_(False)",
                   "model.w.requires_grad_(True)", "with torch.no_grad():\n    model.w.mul_(-1.0)"]),
            ("W", ["model.W.data = model.W.data.t()", "model.W.requires_grad_(False)",
                   "model.W = nn.Parameter(torch.randn(D, 2 * D)[:, ::2]" + to_dtype + ")"]),
            ("buf", ["model.buf.data = torch.randn(D)" + to_dtype, "model.buf.fill_(1.0)",
                     "model.buf = torch.ones(D)" + to_dtype]),
            ("sub", ["model.sub.eval()", "model.sub.train()", "model.sub = Sub()" + to_dtype,
                     "model.sub.gain = 3.0", "model.sub.register_forward_hook(lambda mod, inp, out: out * 2)",
                     "model.sub.stat.add_(1.0)"]),
            ("lin", ["model.lin = nn.Linear(D, D)" + to_dtype, "model.lin.bias = None",
                     "model.lin.register_forward_hook(lambda mod, inp, out: out + 1)"]),
            ("bn", ["model.bn.eval()", "model.bn.train()", "model.bn.momentum = None",
                    "model.bn.running_var.fill_(2.0)",
                    "model.bn = nn.BatchNorm1d(D, affine=False)" + to_dtype]),
            ("count", ["model.count.zero_()"]),
        ):
            if member in members:
                options += changes
        if not options:
            return None
        change = rng.choice(options)
        if change == "model.double()":
            self.dtype = "torch.float64"
        elif change == "model.float()":
            self.dtype = "torch.float32"
        return change
