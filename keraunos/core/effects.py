"""Which torch ops have effects a pass must respect, and what a pass may do with such a line.

Capture tags each recorded line with what is found here (``tags.RANDOM``, ``tags.MUTATION``).
What a pass may do with a tagged line is one table, ``EFFECTS``, asked through four questions
that every pass uses: ``may_drop`` (DCE), ``may_merge`` (CSE, the peephole), ``may_move`` (a
fusion region's hoisting and sinking) and ``may_fuse`` (a fusion executor's claim). A new effect
is a tag (``tags.py``) and one entry here; a tag with no entry has no effect.

- Random ops are known by the op objects themselves, found once in PyTorch's public namespaces
  (ATen overloads by their ``nondeterministic_seeded`` tag), not by how a trace prints them.
  ``tests/test_traces.py`` checks that every name below still finds an op, so a rename in PyTorch
  fails a test instead of silently dropping an op from the set.
- In place is PyTorch's own naming convention (``add_``, ``x[i] = v``, ``x += y``), which is what
  capture has before it runs the op; capture also compares version counters after it runs.
"""
from __future__ import annotations

import functools

import torch

from dataclasses import dataclass

from ..torch_internals.dispatch import OpOverload
from .proxies import TensorProxy
from .symbols import TorchSymbol
from .tags import COPY_OF_WRITTEN_INPUT, MUTATION, OPAQUE, RANDOM, UNDER_AUTOCAST, Tag


@dataclass(frozen=True)
class Effect:
    """What passes may do with a line that carries an effect's tag (all: no)."""

    drop: bool = False   # removed when nothing reads its outputs
    merge: bool = False  # merged with an identical line, or rewritten into one
    move: bool = False   # run earlier or later than written
    fuse: bool = False   # run inside a fused region


EFFECTS: dict[Tag, Effect] = {
    RANDOM: Effect(),    # draws from the generator: how often and in which order is the program's
    MUTATION: Effect(),  # writes a tensor or global state (a fusion executor may still take a
    #                      write it proves safe, see fusion/regions.py's _fusible_write)
    OPAQUE: Effect(),    # an op no fake kernel describes: its effects are unknown
    # The copy capture makes of an input the program writes (the epilogue copies it back): a
    # plain value to DCE and CSE, but it stays where it is and outside regions.
    COPY_OF_WRITTEN_INPUT: Effect(drop=True, merge=True),
    # Autocast's casts made inside the op (not lines of the trace): it must run where autocast
    # is on, which a compiled region is not.
    UNDER_AUTOCAST: Effect(drop=True, merge=True),
}


def forbidding(bsym, what: str) -> set[Tag]:
    """The tags of ``bsym`` whose effect forbids ``what`` (``"drop"``, ``"merge"``, ...)."""
    return {t for t in bsym.tags if t in EFFECTS and not getattr(EFFECTS[t], what)}


def _allows(bsym, what: str) -> bool:
    return all(getattr(EFFECTS[t], what) for t in bsym.tags if t in EFFECTS)


def may_drop(bsym) -> bool:
    """Whether a pass may remove the line when nothing reads its outputs."""
    return _allows(bsym, "drop") and not writes_running_statistics(bsym)


def may_merge(bsym) -> bool:
    """Whether a pass may merge the line with an identical one (or fold it into another)."""
    return _allows(bsym, "merge") and not writes_running_statistics(bsym)


@functools.cache
def _statistics_arguments() -> dict[int, tuple]:
    """id(op) -> (positions of the running mean and variance, position and keyword of the flag
    that makes the op update them, the flag's default), for the normalizations that update
    running statistics in place, in each of the spellings a trace holds."""
    F, aten = torch.nn.functional, torch.ops.aten
    table = {id(F.batch_norm): ((1, 2, "running_mean", "running_var"), (5, "training"), False),
             id(F.instance_norm): ((1, 2, "running_mean", "running_var"), (5, "use_input_stats"),
                                   True)}
    native = ((3, 4, "running_mean", "running_var"), (5, "training"), False)
    for op in (torch.batch_norm, torch.native_batch_norm, torch.instance_norm):
        table[id(op)] = native
    for name in ("batch_norm", "native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm",
                 "instance_norm"):
        packet = getattr(aten, name, None)
        if packet is not None:
            table.update({id(getattr(packet, o)): native for o in packet.overloads()})
    return table


def writes_running_statistics(bsym) -> bool:
    """Whether the line is a batch or instance norm that updates its running statistics in place
    (in training): PyTorch's schemas do not mark those arguments written and a fake kernel bumps
    no version counter, so no tag says it; the line must run once per time it is written, even
    when nothing reads its result."""
    arguments = _statistics_arguments().get(id(getattr(bsym.symbol, "fn", None)))
    if arguments is None:
        return False
    (mean_at, var_at, mean_kw, var_kw), (flag_at, flag_kw), default = arguments
    args, kwargs = bsym.args, bsym.kwargs

    def argument(at, keyword, absent=None):
        return args[at] if len(args) > at else kwargs.get(keyword, absent)
    stats = (argument(mean_at, mean_kw), argument(var_at, var_kw))
    return bool(argument(flag_at, flag_kw, default)) and any(
        isinstance(t, TensorProxy) for t in stats)


def may_move(bsym) -> bool:
    """Whether a pass may run the line earlier or later than written."""
    return _allows(bsym, "move")


def may_fuse(bsym) -> bool:
    """Whether a fusion executor may run the line inside a region."""
    return _allows(bsym, "fuse")

# Where the random ops live, and their names there.
_RANDOM_NAMESPACES = ("torch", "torch.Tensor", "torch.nn.functional", "torch.nn.init")
RANDOM_OP_NAMES = frozenset({
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal",
    "bernoulli", "multinomial", "poisson", "dropout", "alpha_dropout", "feature_alpha_dropout",
    "dropout1d", "dropout2d", "dropout3d", "rrelu", "uniform_", "normal_", "bernoulli_",
    "exponential_", "geometric_", "log_normal_", "cauchy_", "random_", "gumbel_softmax",
    "fractional_max_pool2d", "fractional_max_pool3d", "native_dropout", "rrelu_", "dropout_",
    "uniform", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
    "trunc_normal_", "orthogonal_", "sparse_",
})


@functools.lru_cache(maxsize=None)
def random_ops() -> dict[str, list]:
    """Each random op name -> the op objects of that name in the public namespaces."""
    found: dict[str, list] = {name: [] for name in RANDOM_OP_NAMES}
    for namespace in _RANDOM_NAMESPACES:
        mod = eval(namespace, {"torch": torch})
        for name in RANDOM_OP_NAMES:
            op = getattr(mod, name, None)
            if callable(op):
                found[name].append(op)
    return found


@functools.lru_cache(maxsize=None)
def _random_ids() -> frozenset[int]:
    # By id: the ops are module attributes that live as long as torch, and some are unhashable.
    return frozenset(id(op) for ops in random_ops().values() for op in ops)


def is_random(symbol: TorchSymbol) -> bool:
    """Whether the op always draws from the global generator. (Attention ops are seeded but draw
    only when their ``dropout_p`` is not zero: a question about the call, not the op.)"""
    fn = symbol.fn
    if isinstance(fn, OpOverload):
        return torch.Tag.nondeterministic_seeded in fn.tags and \
            "dropout_p" not in (a.name for a in fn._schema.arguments)
    return id(fn) in _random_ids()


@functools.lru_cache(maxsize=None)
def _dropouts() -> dict[int, tuple[str, bool | None]]:
    """The dropout functions by id -> the name and default of their ``training`` argument (the
    third; ``p`` is the second). In eval mode, or with ``p == 0``, they return their input and
    draw nothing (ATen's ``dropout`` returns early before touching the generator)."""
    F = torch.nn.functional
    table = {F.dropout: ("training", True), F.dropout1d: ("training", True),
             F.dropout2d: ("training", True), F.dropout3d: ("training", True),
             F.alpha_dropout: ("training", False), F.feature_alpha_dropout: ("training", False),
             torch.dropout: ("train", None), torch.alpha_dropout: ("train", None),
             torch.feature_alpha_dropout: ("train", None)}
    return {id(fn): spec for fn, spec in table.items()}


def _dropout_is_identity(fn, args: tuple, kwargs: dict) -> bool:
    name, default = _dropouts()[id(fn)]
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    training = args[2] if len(args) > 2 else kwargs.get(name, default)
    return training is False or (type(p) in (int, float) and p == 0)


def draws_random(symbol: TorchSymbol, args: tuple, kwargs: dict) -> bool:
    """Whether this call draws from the global generator: a random op (but not a dropout in eval
    mode or with ``p=0``), or attention (the ATen overloads with a ``dropout_p`` argument,
    ``F.scaled_dot_product_attention``) with dropout."""
    fn = symbol.fn
    if id(fn) in _dropouts():
        return not _dropout_is_identity(fn, args, kwargs)
    if is_random(symbol):
        return True
    if isinstance(fn, OpOverload):
        names = [a.name for a in fn._schema.arguments]
        if "dropout_p" not in names or torch.Tag.nondeterministic_seeded not in fn.tags:
            return False
        i = names.index("dropout_p")
    elif fn is torch.nn.functional.scaled_dot_product_attention:
        i = 4
    else:
        return False
    p = args[i] if i < len(args) else kwargs.get("dropout_p", 0.0)
    return not (isinstance(p, (int, float)) and p == 0)  # a symbolic p: assume it draws


_INPLACE_OPERATORS = {"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and",
                      "or", "xor", "lshift", "rshift"}


def is_inplace_by_name(symbol: TorchSymbol) -> bool:
    """Whether PyTorch's naming says the op writes its first argument in place."""
    if isinstance(symbol.fn, OpOverload):
        return symbol.fn._schema.is_mutable
    short = symbol.name.rsplit(".", 1)[-1]
    return (short.endswith("_") and not short.endswith("__")) or symbol.style == "setitem" or (
        symbol.style == "operator" and short.startswith("__i") and short[3:-2] in
        _INPLACE_OPERATORS)


# In-place changes of a tensor's metadata (not its data), each with its functional view. On fake
# tensors autograd replays views from their view functions, which miss these changes.
METADATA_WRITES = {
    torch.Tensor.t_: torch.Tensor.t,
    torch.Tensor.transpose_: torch.Tensor.transpose,
    torch.Tensor.swapdims_: torch.Tensor.swapdims,
    torch.Tensor.swapaxes_: torch.Tensor.swapaxes,
    torch.Tensor.squeeze_: torch.Tensor.squeeze,
    torch.Tensor.unsqueeze_: torch.Tensor.unsqueeze,
    torch.Tensor.as_strided_: torch.Tensor.as_strided,
}
