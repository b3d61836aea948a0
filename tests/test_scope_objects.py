"""Objects the program finds by name: a global or closure variable of the jitted function or of a
helper it calls, and the object of a jitted bound method (``keraunos.jit(optimizer.step)``).

Capture used to read their attributes unseen and compile the values in: after ``cfg.scale = 3.0``
a cached program kept multiplying by 2, and a method that filled a dict of its object's on the
first call (an optimizer's state) left a fake tensor there and initialised it again on every
call. Each read is now guarded (a change recompiles), and a program that changes such an object
(sets an attribute, fills a dict it holds) has the change undone and takes the fallback route.
Every test compares with eager.
"""
from __future__ import annotations

import collections
import copy
import logging
import warnings

import pytest
import torch
from torch.testing import assert_close

import keraunos
from keraunos.errors import LazyStateError, ScopeMutationError, UnguardableStateError


class Settings:
    def __init__(self):
        self.scale = 2.0
        self.offsets = {"a": 1.0}
        self.bias = torch.ones(3)


SETTINGS = Settings()


def scaled(x):
    return x * SETTINGS.scale + SETTINGS.offsets["a"] + SETTINGS.bias


def test_a_global_objects_attributes_are_guarded():
    x = torch.randn(3)
    jitted = keraunos.jit(scaled)
    assert_close(jitted(x), scaled(x))
    try:
        SETTINGS.scale = 3.0
        assert_close(jitted(x), scaled(x))
        SETTINGS.offsets["a"] = 5.0
        assert_close(jitted(x), scaled(x))
        SETTINGS.bias = torch.zeros(3)
        assert_close(jitted(x), scaled(x))
    finally:
        SETTINGS.scale, SETTINGS.offsets, SETTINGS.bias = 2.0, {"a": 1.0}, torch.ones(3)
    assert keraunos.cache_misses(jitted) >= 3  # each change recompiled


def test_a_closure_objects_attributes_are_guarded():
    settings = Settings()

    def f(x):
        return x * settings.scale

    x = torch.randn(4)
    jitted = keraunos.jit(f)
    assert_close(jitted(x), f(x))
    settings.scale = -1.5
    assert_close(jitted(x), f(x))


class Scaler:
    def __init__(self):
        self.k = 2.0
        self.t = torch.ones(3)

    def apply(self, x):
        return x * self.k + self.t


def test_a_bound_methods_object_is_read_as_self_with_guards():
    scaler, x = Scaler(), torch.randn(3)
    jitted = keraunos.jit(scaler.apply)
    assert_close(jitted(x), scaler.apply(x))
    scaler.k, scaler.t = 10.0, torch.full((3,), 4.0)
    assert_close(jitted(x), scaler.apply(x))


class Accumulator:
    def __init__(self):
        self.state = {}

    def step(self, x):
        if "m" not in self.state:
            self.state["m"] = torch.zeros_like(x)
        self.state["m"].add_(x)
        return self.state["m"] * 1


def test_a_method_that_fills_its_objects_dict_runs_that_call_eagerly_then_is_captured():
    x = torch.randn(3)
    ours, eager = Accumulator(), Accumulator()
    jitted = keraunos.jit(ours.step, fallback="error")  # no fallback taken: captured
    for _ in range(3):
        assert_close(jitted(x), eager.step(x))
    assert type(ours.state["m"]) is torch.Tensor  # a real tensor, never capture's fake
    assert_close(ours.state["m"], eager.state["m"])
    assert keraunos.last_traces(jitted)  # the second call captured the program
    assert keraunos.cache_hits(jitted) == 1  # the third ran it


class Growing:
    """Adds an entry on every call: no call can be captured."""

    def __init__(self):
        self.seen = {}

    def step(self, x):
        self.seen[len(self.seen)] = 1.0
        return x * len(self.seen)


def test_a_method_that_adds_state_on_every_call_takes_the_fallback_after_a_few_eager_calls():
    x, ours, eager = torch.randn(3), Growing(), Growing()
    with pytest.raises(LazyStateError, match="seen"):
        jitted = keraunos.jit(ours.step, fallback="error")
        for _ in range(10):
            assert_close(jitted(x), eager.step(x))
    assert len(ours.seen) == len(eager.seen) == 4  # the eager calls, then the refusal


class Counter:
    def __init__(self):
        self.calls = 0


COUNTER = Counter()


def counted(x):
    COUNTER.calls = COUNTER.calls + 1
    return x + COUNTER.calls


def test_an_attribute_the_program_sets_on_a_global_object_is_undone_and_falls_back():
    x = torch.zeros(2)
    with pytest.raises(ScopeMutationError, match="attribute 'calls'"):
        keraunos.jit(counted, fallback="error")(x)
    assert COUNTER.calls == 0  # undone
    jitted = keraunos.jit(counted)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = [jitted(x).tolist() for _ in range(3)]
    assert results == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]] and COUNTER.calls == 3


def test_jitting_an_optimizer_step_trains_like_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    reference, x = copy.deepcopy(model), torch.randn(5, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eager_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = keraunos.jit(optimizer.step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(4):
            if i == 2:  # a scheduler's change of the learning rate is seen
                for o in (optimizer, eager_optimizer):
                    o.param_groups[0]["lr"] = 5e-3
            for m, o, s in ((model, optimizer, step), (reference, eager_optimizer,
                                                        eager_optimizer.step)):
                o.zero_grad(set_to_none=True)
                m(x).square().mean().backward()
                s()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_close(p, q)
    for p, q in zip(model.parameters(), reference.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert type(optimizer.state[p][key]) is torch.Tensor
            assert_close(optimizer.state[p][key], eager_optimizer.state[q][key])


def test_an_ordered_dict_an_object_holds_is_checked_by_identity_and_items():
    class Hooked:
        def __init__(self):
            import collections
            self.hooks = collections.OrderedDict(a=1.0)

        def apply(self, x):
            return x * sum(self.hooks.values())

    obj, x = Hooked(), torch.randn(3)
    jitted = keraunos.jit(obj.apply, fallback="error")
    assert_close(jitted(x), obj.apply(x))
    obj.hooks["a"] = 3.0  # a value changed
    assert_close(jitted(x), obj.apply(x))
    obj.hooks["b"] = 0.5  # a key added
    assert_close(jitted(x), obj.apply(x))
    obj.hooks = collections.OrderedDict(a=3.0, b=0.5)  # equal, but another object
    assert_close(jitted(x), obj.apply(x))
    assert keraunos.cache_misses(jitted) == 4


def test_state_keraunos_cannot_check_takes_the_fallback_route():
    class Hooked:
        def __init__(self):
            self.scales = {1.0}  # a set: read in C, not checked

        def apply(self, x):
            return x * max(self.scales)

    obj, x = Hooked(), torch.randn(3)
    with pytest.raises(UnguardableStateError, match="scales"):
        keraunos.jit(obj.apply, fallback="error")(x)
    jitted = keraunos.jit(obj.apply)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_close(jitted(x), obj.apply(x))
        obj.scales.add(3.0)
        assert_close(jitted(x), obj.apply(x))


LOG = logging.getLogger("keraunos.tests.scope_objects")


def logs_and_computes(x):
    LOG.debug("computing")
    return x.sin()


def test_a_standard_library_object_is_only_called_not_watched():
    x = torch.randn(3)
    jitted = keraunos.jit(logs_and_computes)
    assert_close(jitted(x), logs_and_computes(x))
    assert_close(jitted(x), logs_and_computes(x))
    assert keraunos.cache_misses(jitted) == 1
    assert type(LOG) is logging.Logger


class Outer:
    def __init__(self):
        self.inner = Settings()


OUTER = Outer()


def through_inner(x):
    return x * OUTER.inner.scale


def sets_inner(x):
    OUTER.inner.scale = OUTER.inner.scale + 1.0
    return x * OUTER.inner.scale


def test_an_object_held_by_a_global_object_is_watched_as_well():
    x = torch.randn(3)
    jitted = keraunos.jit(through_inner)
    assert_close(jitted(x), through_inner(x))
    try:
        OUTER.inner.scale = 7.0
        assert_close(jitted(x), through_inner(x))
        with pytest.raises(ScopeMutationError, match="scale"):
            keraunos.jit(sets_inner, fallback="error")(x)
        assert OUTER.inner.scale == 7.0  # undone
    finally:
        OUTER.inner.scale = 2.0


TABLE = collections.OrderedDict(a=1.0)
ENABLED = {"sin"}


def table_read(x):
    y = x * TABLE["a"]
    return y.sin() if "sin" in ENABLED else y.cos()


def test_a_global_ordered_dict_or_set_of_plain_values_is_compared_by_value():
    x = torch.randn(3)
    jitted = keraunos.jit(table_read)
    assert_close(jitted(x), table_read(x))
    try:
        TABLE["a"] = 4.0
        assert_close(jitted(x), table_read(x))
        ENABLED.clear()
        assert_close(jitted(x), table_read(x))
    finally:
        TABLE["a"] = 1.0
        ENABLED.add("sin")


ACTIVATIONS = [torch.relu]
CONFIGS = {"main": Settings()}


def activated(x):
    return ACTIVATIONS[0](x) * CONFIGS["main"].scale


def test_a_global_list_or_dict_of_functions_and_objects_is_checked_item_by_item():
    x = torch.randn(4)
    jitted = keraunos.jit(activated)
    assert_close(jitted(x), activated(x))
    try:
        ACTIVATIONS[0] = torch.tanh
        assert_close(jitted(x), activated(x))
        CONFIGS["main"].scale = 0.25
        assert_close(jitted(x), activated(x))
        CONFIGS["main"] = Settings()
        assert_close(jitted(x), activated(x))
    finally:
        ACTIVATIONS[0] = torch.relu
        CONFIGS["main"] = Settings()


class Flags:
    def __init__(self):
        self.flag = None


class SetsItsConfig(torch.nn.Module):
    """Sets an attribute of an object it holds on its first call (Hugging Face models set
    ``config.problem_type`` this way), and computes otherwise once it is set."""

    def __init__(self):
        super().__init__()
        self.cfg = Flags()

    def forward(self, x):
        if self.cfg.flag is None:
            self.cfg.flag = True
            return x * 2
        return x * 3


def test_an_attribute_the_program_sets_on_an_object_its_module_holds_is_replayed_and_checked():
    x = torch.randn(3)
    model, reference = SetsItsConfig(), SetsItsConfig()
    jitted = keraunos.jit(model)
    for _ in range(3):
        assert_close(jitted(x), reference(x))
        assert model.cfg.flag is reference.cfg.flag
    assert keraunos.cache_misses(jitted) == 2  # the second call finds the flag set, as eager


# What a review of the change found: objects that cannot be watched, attributes of the class or
# absent, an object reached both as an argument and by name, tensors in a global list, a module
# namespace that caches attributes.
import dataclasses  # noqa: E402
import functools  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Frozen:
    scale: float


ACTIVATION = functools.partial(torch.nn.functional.gelu, approximate="tanh")
FROZEN = Frozen(2.0)


def partial_and_frozen(x):
    return ACTIVATION(x) * FROZEN.scale


def test_a_global_that_cannot_be_watched_is_still_the_same_object():
    global ACTIVATION, FROZEN
    x = torch.randn(5)
    jitted = keraunos.jit(partial_and_frozen)
    assert_close(jitted(x), partial_and_frozen(x))
    old = ACTIVATION, FROZEN
    try:
        ACTIVATION = functools.partial(torch.nn.functional.gelu, approximate="none")
        assert_close(jitted(x), partial_and_frozen(x))
        FROZEN = Frozen(3.0)
        assert_close(jitted(x), partial_and_frozen(x))
    finally:
        ACTIVATION, FROZEN = old


class WithDefaults:
    dropout = 0.0  # a class attribute


DEFAULTS = WithDefaults()


def reads_defaults(x):
    return x * (1 - DEFAULTS.dropout) + getattr(DEFAULTS, "shift", 0.0)


def test_class_attributes_and_absent_attributes_of_a_global_object_are_checked():
    x = torch.randn(3)
    jitted = keraunos.jit(reads_defaults)
    assert_close(jitted(x), reads_defaults(x))
    try:
        DEFAULTS.dropout = 0.5
        assert_close(jitted(x), reads_defaults(x))
        DEFAULTS.shift = 1.0
        assert_close(jitted(x), reads_defaults(x))
    finally:
        del DEFAULTS.dropout, DEFAULTS.shift


class Holder:
    def __init__(self, t):
        self.t = t


HELD = Holder(torch.ones(3))


def argument_and_global(x, holder):
    return x + HELD.t + holder.t


def test_an_object_passed_in_and_found_by_name_is_checked_both_ways():
    x = torch.randn(3)
    jitted = keraunos.jit(argument_and_global)
    assert_close(jitted(x, HELD), argument_and_global(x, HELD))
    other = Holder(torch.zeros(3))
    assert_close(jitted(x, other), argument_and_global(x, other))


WEIGHTS = [torch.ones(3)]


def weighted(x):
    return x * WEIGHTS[0]


def test_a_tensor_in_a_global_list_is_read_on_every_call():
    x = torch.randn(3)
    jitted = keraunos.jit(weighted)
    assert_close(jitted(x), weighted(x))
    try:
        WEIGHTS[0] = torch.full((3,), 5.0)
        assert_close(jitted(x), weighted(x))
    finally:
        WEIGHTS[0] = torch.ones(3)


ATEN = torch.ops.aten


def through_an_op_namespace(x):
    return ATEN.sinh(x) + ATEN.cosh(x)


def test_a_module_namespace_that_caches_attributes_compiles_without_falling_back():
    x = torch.randn(3)
    jitted = keraunos.jit(through_an_op_namespace, fallback="error")
    assert_close(jitted(x), through_an_op_namespace(x))
    assert keraunos.last_traces(jitted)


_COLLECTIONS_SEEN = {}


def _count_collections(phase, info):
    _COLLECTIONS_SEEN[phase] = _COLLECTIONS_SEEN.get(phase, 0) + 1


def test_a_garbage_collector_callback_during_capture_is_not_the_programs():
    """A ``gc.callbacks`` function runs wherever an allocation triggers a collection, capture
    included: its writes to its own globals are not the program's (no refusal, no guard on
    them), it still runs, and ``gc.callbacks`` holds the user's own function again afterwards."""
    import gc

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).relu() * 2

    m = M()
    jm = keraunos.jit(m, fallback="error")
    x = torch.randn(2, 4)
    thresholds = gc.get_threshold()
    gc.callbacks.append(_count_collections)
    try:
        gc.set_threshold(1, 1, 1)  # a collection on nearly every allocation: several in capture
        before = sum(_COLLECTIONS_SEEN.values())
        out = jm(x)
        again = jm(x)
        assert sum(_COLLECTIONS_SEEN.values()) > before
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(_count_collections)  # the very function: the wrapper is gone
    assert torch.equal(out, m(x)) and torch.equal(again, m(x))
    assert keraunos.cache_misses(jm) == 1


def test_a_class_a_helper_reads_from_its_own_modules_registry_is_checked_not_refused():
    """A helper of another module reads a class out of a registry in its module's globals
    (transformers' ``_CAN_RECORD_REGISTRY[...].target_class``): the class is found by name,
    so the prologue checks it by identity, as for the jitted function's own globals."""
    import sys
    import textwrap
    import types

    module = types.ModuleType("keraunos_test_registry_helper")
    exec(textwrap.dedent("""
        import torch

        class Spec:
            def __init__(self, cls):
                self.target_class = cls

        REGISTRY = {"linear": Spec(torch.nn.Linear)}

        def scale_if_registered(layer, x):
            if isinstance(layer, REGISTRY["linear"].target_class):
                return x * 2
            return x
    """), module.__dict__)
    sys.modules[module.__name__] = module
    try:
        layer = torch.nn.Linear(3, 3)

        def program(x):
            return module.scale_if_registered(layer, x) + 1

        jitted = keraunos.jit(program, fallback="error")
        x = torch.randn(3)
        torch.testing.assert_close(jitted(x), program(x))
        module.REGISTRY["linear"] = module.Spec(torch.nn.Conv1d)  # the class read changes
        torch.testing.assert_close(jitted(x), program(x))
        assert keraunos.cache_misses(jitted) == 2
    finally:
        del sys.modules[module.__name__]
