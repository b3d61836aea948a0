"""Float symbols in regions: a learning rate that a scheduler changes on every step (``s0``, a
float the prologue reads from ``param_groups[0]['lr']``) read by lines a region computes.

Inductor's kernels take tensors and integer sizes. A float symbol enters a region's kernel as a
0-dim float64 tensor holding the call's value (its *stand-in*, made by ``RegionCall`` on each
call, ``as_stand_ins``): the graph computes the trace's expression of it (``1.0 + (-0.01)*s0``)
on that tensor in float64, as Python computes it in double, and converts the result to the
dtype of the line that reads it before the op, as eager converts a Python scalar to the
tensor's type. So ``p.mul_(1.0 + (-0.01)*s0)`` multiplies by the same float32 as eager, and
``s0 / t`` (``Tensor.__rtruediv__``: ``t.reciprocal() * s0``) keeps eager's two steps.

Only ops whose float operand may equally be a 0-dim tensor take one: arithmetic and ``lerp``,
with the float as a positional argument (or ``alpha=``), on the CPU, making float32 or float64;
or bfloat16 or float16 from a tensor of more than 0 dims, where eager computes with the scalar in
float32 (its type for them: a 0-dim float32 tensor then keeps the result's dtype and value).
Other lines that read a float symbol run on the next executor.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...core.proxies import NumberProxy, TensorProxy
from ...core.symbolic import SymbolicValue

# The stand-in's metadata, as a tensor input's: (shape, stride, dtype, device).
STAND_IN = ((), (), torch.float64, torch.device("cpu"))

# Ops that compute the same with their float operand given as a 0-dim tensor of the type they
# compute in: by name, for methods and operators; by function, for ``torch.mul(t, s0)``.
_OPERAND_NAMES = frozenset({
    "mul", "mul_", "multiply", "div", "div_", "divide", "true_divide", "add", "add_", "sub",
    "sub_", "subtract", "lerp", "lerp_", "__mul__", "__rmul__", "__imul__", "__truediv__",
    "__rtruediv__", "__itruediv__", "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__",
    "__isub__"})
_OPERAND_FUNCTIONS = (torch.mul, torch.multiply, torch.div, torch.divide, torch.true_divide,
                      torch.add, torch.sub, torch.subtract, torch.lerp)
_DTYPES = (torch.float32, torch.float64)
_REDUCED = (torch.bfloat16, torch.float16)  # computed with a float32 scalar, from a larger tensor


def is_float_symbol(p) -> bool:
    """A float symbol of the trace among a line's or a region's inputs."""
    return isinstance(p, NumberProxy) and p.python_type is float and p.symbol is not None


def is_float_argument(x) -> bool:
    """A float symbol, or an expression of float symbols only (``1.0 + (-0.01)*s0``) that the
    graph can compute: sums, products and integer powers of symbols and numbers."""
    if isinstance(x, SymbolicValue):
        return isinstance(x.value, torch.SymFloat) and bool(x.proxies) and \
            all(map(is_float_symbol, x.proxies)) and _computable(x.value.node.expr)
    return is_float_symbol(x)


def _computable(expr) -> bool:
    import sympy
    if expr.is_Symbol or expr.is_Number:
        return expr.is_Symbol or expr.is_finite
    if isinstance(expr, sympy.Pow):
        return expr.exp.is_Integer and _computable(expr.base)
    return isinstance(expr, (sympy.Add, sympy.Mul)) and all(map(_computable, expr.args))


def takes_float_operand(bsym, leaves) -> bool:
    """Whether the line, whose argument leaves include float symbols, may read them in a region:
    an op of the list above with each one positional (or ``alpha=``), on the CPU, making float32
    or float64, or bfloat16 or float16 of more than 0 dims."""
    symbol = bsym.symbol
    if symbol.style == "function":
        if not any(symbol.fn is f for f in _OPERAND_FUNCTIONS):
            return False
    elif symbol.style not in ("method", "operator") or symbol.name not in _OPERAND_NAMES:
        return False
    for key, v in bsym.kwargs.items():  # ``value=``: a Scalar only; ``alpha=`` is rewritten
        if is_float_argument(v) and not (key == "alpha" and _scales_a_tensor(bsym)):
            return False
    outputs = [p for p in bsym.output_proxies() if isinstance(p, TensorProxy)] or \
        [a for a in bsym.args[:1] if isinstance(a, TensorProxy)]
    tensors = [x for x in leaves if isinstance(x, TensorProxy)] + outputs
    return bool(outputs) and all(p.dtype in _DTYPES or p.dtype in _REDUCED and len(p.shape) > 0
                                 for p in outputs) and \
        all(t.device.type == "cpu" for t in tensors)


_ALPHA_NAMES = frozenset({"add", "add_", "sub", "sub_", "subtract"})


def _scales_a_tensor(bsym) -> bool:
    """``p.add_(buf, alpha=-s0)`` (SGD's update): computed as ``p.add_(buf * -s0)``, as
    Inductor computes a constant ``alpha``."""
    symbol = bsym.symbol
    named = symbol.name in _ALPHA_NAMES if symbol.style == "method" else \
        any(symbol.fn is f for f in (torch.add, torch.sub, torch.subtract))
    return named and len(bsym.args) == 2 and all(isinstance(a, TensorProxy) for a in bsym.args)


# ------------------------------------------------------------------------------- the graph
def expression_node(graph: fx.Graph, value: SymbolicValue, env: dict) -> fx.Node:
    """The node computing a float expression on the stand-ins of its symbols (``env``: trace
    name -> node), in the order the trace's code computes it (its text, run on FX proxies)."""
    tracer = fx.proxy.GraphAppendingTracer(graph)
    names = {p.name: fx.Proxy(env[p.name], tracer) for p in value.proxies}
    made = eval(str(value), {"__builtins__": {}}, names)  # noqa: S307 - the trace's own code
    return made.node


def scaled_by_alpha(graph: fx.Graph, args: tuple, kwargs: dict, dtype: torch.dtype):
    """``add(a, b, alpha=x)`` with a float value ``x`` as ``add(a, b * x)``."""
    kwargs = dict(kwargs)
    alpha = as_operand(graph, kwargs.pop("alpha"), dtype)
    return (args[0], graph.call_method("mul", (args[1], alpha))), kwargs


def as_operand(graph: fx.Graph, node: fx.Node, dtype: torch.dtype) -> fx.Node:
    """A float value (a float64 node) as the operand of an op making ``dtype``: converted first,
    as eager converts a Python scalar to the type it computes in (float32 for bfloat16)."""
    if dtype in _REDUCED:
        dtype = torch.float32
    return node if dtype == torch.float64 else graph.call_method("to", (node, dtype))


# -------------------------------------------------------------------------------- the call
def positions(inputs) -> tuple[int, ...]:
    return tuple(k for k, p in enumerate(inputs) if is_float_symbol(p))


def stand_in(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64)


def as_stand_ins(args, floats: tuple[int, ...]) -> list:
    """The call's arguments with the floats at ``floats`` as their 0-dim float64 stand-ins."""
    args = list(args)
    for k in floats:
        args[k] = stand_in(args[k])
    return args


def as_floats(args, floats: tuple[int, ...]) -> list:
    """The reverse, for the region's own lines (run where its kernel cannot be)."""
    args = list(args)
    for k in floats:
        if isinstance(args[k], torch.Tensor):
            args[k] = args[k].item()
    return args
