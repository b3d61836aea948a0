"""A program that runs autograd's backward itself (a training step written as one function:
``zero_grad``, the forward, the loss, ``loss.backward()``, clipping, the optimizer; or
``torch.autograd.grad``) against eager PyTorch. Capture records the backward as one line and
expands it into the step's forward and backward (``autograd/in_program.py``): one program, no
fallback. After every call the step leaves what eager leaves: the loss, parameters, ``.grad``
(or ``None``), optimizer state, RNG."""
import copy
import pathlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils import _pytree as pytree

import keraunos
from keraunos.errors import BackwardInProgramError

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
}


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                               torch.nn.Dropout(0.1), torch.nn.Linear(16, 4))


def _training(kind: str = "adamw", *, set_to_none: bool = True, clip: str | None = "norm"):
    model = _model()
    optimizer = OPTIMIZERS[kind](model.parameters())

    def train_step(x, y):
        optimizer.zero_grad(set_to_none=set_to_none)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if clip == "norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        elif clip == "value":
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.05)
        optimizer.step()
        return loss
    return model, optimizer, train_step


def _batches(n: int):
    torch.manual_seed(1)
    return [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(n)]


def _assert_same_training(model, optimizer, eager_model, eager_optimizer, **tolerance):
    for (name, p), q in zip(model.named_parameters(), eager_model.parameters()):
        assert_close(p, q, msg=name, **tolerance)
        if q.grad is None:
            assert p.grad is None, name
        else:
            assert_close(p.grad, q.grad, msg=name, **tolerance)
        state, eager_state = optimizer.state[p], eager_optimizer.state[q]
        assert state.keys() == eager_state.keys(), name
        for key in eager_state:
            assert_close(state[key], eager_state[key], msg=f"{name} {key}", **tolerance)


def _run_both(jitted, step, batches):
    for i, (x, y) in enumerate(batches):
        torch.manual_seed(100 + i)  # dropout draws the same masks on both sides
        got = jitted(x, y)
        rng = torch.get_rng_state()
        torch.manual_seed(100 + i)
        want = step(x, y)
        assert_close(got, want)
        assert rng.equal(torch.get_rng_state())  # the step drew what eager draws


def _no_fallback(caught) -> None:
    falls_back = [str(w.message) for w in caught if "falls back" in str(w.message)
                  or "no backward trace" in str(w.message)]
    assert not falls_back, falls_back


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_whole_training_step_is_one_program_and_trains_like_eager(kind, set_to_none):
    model, optimizer, step = _training(kind, set_to_none=set_to_none)
    eager_model, eager_optimizer, eager_step = _training(kind, set_to_none=set_to_none)
    jitted = keraunos.jit(step, fuse="off")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run_both(jitted, eager_step, _batches(5))
        _assert_same_training(model, optimizer, eager_model, eager_optimizer)
    _no_fallback(caught)
    assert keraunos.cache_hits(jitted) >= 2
    trace = str(keraunos.last_traces(jitted)[-1])
    assert "Backward in the program" in trace and "backward_in_program" not in trace
    assert "_backward_data" in trace  # the backward's ATen ops are lines of the program


@pytest.mark.parametrize("clip", ["value", None])
def test_clipping_by_value_or_none_trains_like_eager(clip):
    model, optimizer, step = _training("sgd", clip=clip)
    eager_model, eager_optimizer, eager_step = _training("sgd", clip=clip)
    _run_both(keraunos.jit(step, fuse="off", fallback="error"), eager_step, _batches(4))
    _assert_same_training(model, optimizer, eager_model, eager_optimizer)


def _fused_adamw_trained_like_eager(steps: int):
    """The fused AdamW step, run ``steps`` times beside eager's and checked against it: the
    model and the jitted step."""
    model, optimizer, step = _training("adamw")
    eager_model, eager_optimizer, eager_step = _training("adamw")
    jitted = keraunos.jit(step, fuse="wait", fallback="error")
    _run_both(jitted, eager_step, _batches(steps))
    _assert_same_training(model, optimizer, eager_model, eager_optimizer)
    return model, jitted


def test_the_fused_step_trains_like_eager_and_runs_forward_backward_and_update_in_regions():
    _, jitted = _fused_adamw_trained_like_eager(4)
    assert "inductor_region" in str(keraunos.last_traces(jitted)[-1])


def test_the_step_counts_of_every_parameter_run_as_one_region():
    # AdamW's step counts and bias corrections (0-dim) move ahead of the update; the bindings
    # of the written counts to their new names (``x_updated = x``) between them must not cut
    # them into a region per parameter.
    model, jitted = _fused_adamw_trained_like_eager(3)
    headers, _ = _update_regions(str(keraunos.last_traces(jitted)[-1]))
    assert len(headers) == 1, headers
    assert all(f"state_values_{k}_step_updated" in headers[0]
               for k in range(len(list(model.parameters()))))


def test_a_step_under_the_default_tiers_trains_like_eager():
    model, optimizer, step = _training("adamw")
    eager_model, eager_optimizer, eager_step = _training("adamw")
    _run_both(keraunos.jit(step, fallback="error"), eager_step, _batches(6))
    _assert_same_training(model, optimizer, eager_model, eager_optimizer)


def _accumulating(micro_batches: int):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_step(xs, ys):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in zip(xs, ys):
            loss = F.cross_entropy(model(x), y) / micro_batches
            loss.backward()
            total = total + loss.detach()
        optimizer.step()
        return total
    return model, optimizer, train_step


def test_gradient_accumulation_over_micro_batches_in_one_step_trains_like_eager():
    model, optimizer, step = _accumulating(3)
    eager_model, eager_optimizer, eager_step = _accumulating(3)
    jitted = keraunos.jit(step, fuse="off", fallback="error")
    batches = _batches(9)
    for i in range(3):
        xs = [b[0] for b in batches[3 * i:3 * i + 3]]
        ys = [b[1] for b in batches[3 * i:3 * i + 3]]
        torch.manual_seed(i)
        got = jitted(xs, ys)
        torch.manual_seed(i)
        assert_close(got, eager_step(xs, ys))
    _assert_same_training(model, optimizer, eager_model, eager_optimizer)


def test_gradients_accumulate_over_calls_before_an_optimizer_step_outside():
    def pair():
        model = _model()

        def micro_step(x, y):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss.detach()
        return model, torch.optim.SGD(model.parameters(), lr=0.1), micro_step
    model, optimizer, step = pair()
    eager_model, eager_optimizer, eager_step = pair()
    jitted = keraunos.jit(step, fuse="off", fallback="error")
    grad_before = None
    for i, (x, y) in enumerate(_batches(6)):
        torch.manual_seed(i)
        got = jitted(x, y)
        torch.manual_seed(i)
        assert_close(got, eager_step(x, y))
        if i % 3 == 1:  # accumulated into the .grad the user holds, in place, as eager does
            assert model[0].weight.grad is grad_before
        grad_before = model[0].weight.grad
        if i % 3 == 2:
            optimizer.step()
            eager_optimizer.step()
            optimizer.zero_grad()
            eager_optimizer.zero_grad()
            grad_before = None
        _assert_same_training(model, optimizer, eager_model, eager_optimizer)


@pytest.mark.parametrize("how", ["backward", "autograd.grad", "autograd.backward",
                                 "backward(inputs=)"])
def test_a_backward_inside_the_program_gives_eagers_result_and_gradients(how):
    def weight():
        torch.manual_seed(2)
        return torch.randn(4, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    (w, b), (eager_w, eager_b) = weight(), weight()

    def program(x, w=w, b=b):
        y = (x @ w + b).tanh().sum()
        if how == "autograd.grad":
            return torch.autograd.grad(y, w)[0] * 2
        if how == "backward":
            y.backward()
        elif how == "backward(inputs=)":
            y.backward(inputs=[b])
        else:
            torch.autograd.backward([y])
        return y.detach()

    x = torch.randn(2, 4)
    jitted = keraunos.jit(program, fallback="error")
    for _ in range(2):
        got = jitted(x)
        want = program(x, eager_w, eager_b)
        assert_close(got, want)
        for p, q in ((w, eager_w), (b, eager_b)):
            if q.grad is None:
                assert p.grad is None
            else:
                assert_close(p.grad, q.grad)


def test_setting_grad_to_none_inside_the_program_is_written_back():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()

    def clear():
        optimizer.zero_grad(set_to_none=True)
    keraunos.jit(clear, fallback="error")()
    assert all(p.grad is None for p in model.parameters())


def test_a_backward_with_create_graph_is_refused_naming_the_line():
    model = _model()

    def penalized(x):
        loss = model(x).square().mean()
        (grad,) = torch.autograd.grad(loss, model[0].weight, create_graph=True)
        return loss + grad.square().sum()
    with pytest.raises(BackwardInProgramError,
                       match=r"torch.autograd.grad\(loss(.|\n)*create_graph=True(.|\n)*What to do"):
        keraunos.jit(penalized, fallback="error")(torch.randn(4, 8))
    assert all(p.grad is None for p in model.parameters())


def test_a_backward_through_an_input_that_is_not_a_leaf_is_refused_and_leaves_state_alone():
    model = _model()
    before = copy.deepcopy(model.state_dict())
    source = torch.randn(4, 8, requires_grad=True)

    def step(x):
        loss = model(x).sum()
        loss.backward()
        return loss

    with pytest.raises(BackwardInProgramError, match=r"not a leaf(.|\n)*What to do"):
        keraunos.jit(step, fallback="error")(source * 2)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert all(p.grad is None for p in model.parameters()) and source.grad is None


SCHEDULERS = {  # (learning rate, scheduler, whether its step takes the loss)
    "step-float": (1e-2, lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
                   False),
    "lambda-tensor": (torch.tensor(1e-2),
                      lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1 / (1 + e)), False),
    "plateau": (1e-2, lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0), True),
    "cosine-float": (1e-2, lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10),
                     False),
    "onecycle-tensor": (torch.tensor(1e-2), lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, 0.05, total_steps=20, cycle_momentum=False), False),
}


def _assert_same_scheduler(scheduler, eager_scheduler):
    """Counters, rates and phases alike; numbers within float rounding (ReduceLROnPlateau keeps
    the best loss, which the program computes within rounding of eager's)."""
    leaves, spec = pytree.tree_flatten(scheduler.state_dict())
    eager_leaves, eager_spec = pytree.tree_flatten(eager_scheduler.state_dict())
    assert spec == eager_spec
    for got, want in zip(leaves, eager_leaves):
        if isinstance(want, torch.Tensor):
            assert_close(got, want)
        elif isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-5)  # a float32 loss, as a Python float
        else:
            assert got == want


def _scheduled(kind: str, zero_grad_last: bool = False, read_after: bool = False,
               optimizer: str = "adamw"):
    lr, make_scheduler, takes_loss = SCHEDULERS[kind]
    model = _model()
    optimizer = OPTIMIZERS[optimizer](model.parameters())
    for group in optimizer.param_groups:
        group["lr"] = lr.clone() if torch.is_tensor(lr) else lr
    scheduler = make_scheduler(optimizer)

    def train_step(x, y):
        if not zero_grad_last:
            optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step(loss.detach()) if takes_loss else scheduler.step()
        if zero_grad_last:
            optimizer.zero_grad(set_to_none=True)
        if read_after:
            return loss, scheduler.get_last_lr()[0]
        return loss
    return model, optimizer, scheduler, train_step


@pytest.mark.parametrize("kind,fuse", [(kind, "off") for kind in sorted(SCHEDULERS)] + [
    ("cosine-float", "wait"), ("lambda-tensor", "wait")])
def test_a_scheduler_stepped_inside_is_part_of_the_one_program_and_trains_like_eager(kind, fuse):
    model, optimizer, scheduler, step = _scheduled(kind, zero_grad_last=kind != "step-float")
    eager_model, eager_optimizer, eager_scheduler, eager_step = _scheduled(
        kind, zero_grad_last=kind != "step-float")
    jitted = keraunos.jit(step, fuse=fuse, fallback="error")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run_both(jitted, eager_step, _batches(6))
    _no_fallback(caught)
    _assert_same_training(model, optimizer, eager_model, eager_optimizer)
    _assert_same_scheduler(scheduler, eager_scheduler)
    for group, eager_group in zip(optimizer.param_groups, eager_optimizer.param_groups):
        assert_close(group["lr"], eager_group["lr"])
    assert keraunos.cache_hits(jitted) >= 1
    epilogue = str(keraunos.last_epilogue_traces(jitted)[-1])
    assert f"_{type(scheduler).__name__}_step" in epilogue, epilogue  # made after the computation
    if kind.endswith("-tensor"):  # a tensor rate is read by the program: no recompile
        assert keraunos.cache_misses(jitted) == 2  # the first call makes AdamW's state eagerly
    if kind == "cosine-float":  # a float rate that changed is a symbol from then on
        assert keraunos.cache_misses(jitted) == 3
        prologue = str(keraunos.last_prologue_traces(jitted)[-1])
        assert "param_groups[0]['lr'] is a float (compiled as the symbol" in prologue


@pytest.mark.parametrize("kind,fuse", [(kind, "off") for kind in sorted(OPTIMIZERS)] + [
    ("sgd", "wait")])
def test_a_learning_rate_changed_on_every_step_compiles_once_as_a_symbol(kind, fuse):
    model, optimizer, scheduler, step = _scheduled("cosine-float", optimizer=kind)
    eager_model, eager_optimizer, eager_scheduler, eager_step = _scheduled(
        "cosine-float", optimizer=kind)
    jitted = keraunos.jit(step, fuse=fuse, fallback="error")
    _run_both(jitted, eager_step, _batches(8))
    _assert_same_training(model, optimizer, eager_model, eager_optimizer)
    _assert_same_scheduler(scheduler, eager_scheduler)
    # The first call makes the optimizer's state eagerly, the second compiles the rate in, the
    # third finds it changed and compiles it as a symbol; the other five hit that entry.
    assert keraunos.cache_misses(jitted) == 3 and keraunos.cache_hits(jitted) == 5


@pytest.mark.parametrize("kind,dtype", [(kind, torch.float32) for kind in sorted(OPTIMIZERS)] + [
    ("adamw", torch.bfloat16), ("sgd", torch.bfloat16)])
def test_lines_computing_with_a_learning_rate_symbol_run_in_the_fused_regions(kind, dtype):
    """AdamW's decay factor and step size, Adam's step size, SGD's ``add_(buf, alpha=-lr)``:
    read from the rate's symbol inside the regions (as a 0-dim float64 tensor), where they cut
    the update into a region per parameter before. bfloat16 parameters: with the rate as a
    float32 scalar, as eager's kernels compute them."""
    from keraunos.core import tree
    from keraunos.executors.fusion import FusionSymbol, float_symbols
    model, optimizer, scheduler, step = _scheduled("cosine-float", optimizer=kind)
    eager_model, eager_optimizer, eager_scheduler, eager_step = _scheduled(
        "cosine-float", optimizer=kind)
    model.to(dtype), eager_model.to(dtype)  # (the optimizers hold the same parameters)
    jitted = keraunos.jit(step, fuse="wait", fallback="error")
    _run_both(jitted, eager_step, [(x.to(dtype), y) for x, y in _batches(8)])
    # (bfloat16: the fused forward and backward round some values one bfloat16 step apart from
    # eager's, as without a schedule: test_a_fused_step_in_reduced_precision_...)
    tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    _assert_same_training(model, optimizer, eager_model, eager_optimizer, **tolerance)
    _assert_same_scheduler(scheduler, eager_scheduler)
    assert keraunos.cache_misses(jitted) == 3 and keraunos.cache_hits(jitted) == 5
    computation = keraunos.last_traces(jitted)[-1]
    regions = [b for b in computation.bound_symbols if isinstance(b.symbol, FusionSymbol)]
    outside = [b for b in computation.bound_symbols if not isinstance(b.symbol, FusionSymbol)
               and any(map(float_symbols.is_float_argument, tree.leaves((b.args, b.kwargs))))]
    assert outside == [], [str(b) for b in outside]
    assert any(float_symbols.is_float_symbol(p) for b in regions for p in b.args), computation


def _step_of_arguments(model, optimizer, scheduler, x, y):
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss


@pytest.mark.parametrize("kind,fuse", [(kind, "off") for kind in sorted(OPTIMIZERS)] + [
    ("adamw", "wait")])
def test_a_step_taking_its_model_optimizer_and_scheduler_as_arguments_is_one_program(kind, fuse):
    """``train_step(model, optimizer, scheduler, x, y)``: each is the very same object on every
    call (checked), read as if found by name; another model is another entry."""
    def pair():
        model = _model()
        optimizer = OPTIMIZERS[kind](model.parameters())
        return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)
    (model, optimizer, scheduler), (eager_model, eager_optimizer, eager_scheduler) = pair(), pair()
    jitted = keraunos.jit(_step_of_arguments, fuse=fuse, fallback="error")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run_both(lambda x, y: jitted(model, optimizer, scheduler, x, y),
                  lambda x, y: _step_of_arguments(eager_model, eager_optimizer, eager_scheduler,
                                                  x, y), _batches(6))
    _no_fallback(caught)
    _assert_same_training(model, optimizer, eager_model, eager_optimizer)
    _assert_same_scheduler(scheduler, eager_scheduler)
    hits = keraunos.cache_hits(jitted)
    assert hits >= 3, (keraunos.cache_misses(jitted), hits)
    prologue = str(keraunos.last_prologue_traces(jitted)[-1])
    assert "args[0] is the same object as when compiled (Sequential)" in prologue, prologue
    # Another model, optimizer and scheduler: checked, missed, compiled for them.
    (other, other_optimizer, other_scheduler), eager_other = pair(), pair()
    misses = keraunos.cache_misses(jitted)
    _run_both(lambda x, y: jitted(other, other_optimizer, other_scheduler, x, y),
              lambda x, y: _step_of_arguments(*eager_other, x, y), _batches(4))
    _assert_same_training(other, other_optimizer, eager_other[0], eager_other[1])
    assert keraunos.cache_misses(jitted) > misses
    assert any("args[0] is the same object" in r for r in keraunos.last_cache_miss_reasons(jitted))
    _assert_same_training(model, optimizer, eager_model, eager_optimizer)  # left as they were


def test_a_module_passed_to_a_jitted_function_gives_eagers_outputs_and_gradients():
    def loss_of(model, x):
        return model(x).square().mean()
    model, eager_model = _model().eval(), _model().eval()
    jitted = keraunos.jit(loss_of, fallback="error")
    for x, _ in _batches(3):
        got, want = jitted(model, x), loss_of(eager_model, x)
        assert_close(got, want)
        got.backward()
        want.backward()
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert_close(p.grad, q.grad)
    assert keraunos.cache_misses(jitted) == 1 and keraunos.cache_hits(jitted) == 2


def test_reading_the_scheduler_after_its_step_falls_back_and_trains_like_eager():
    model, optimizer, scheduler, step = _scheduled("step-float", read_after=True)
    eager_model, eager_optimizer, eager_scheduler, eager_step = _scheduled(
        "step-float", read_after=True)
    jitted = keraunos.jit(step, fuse="off")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(_batches(4)):
            torch.manual_seed(100 + i)
            (loss, lr), (eager_loss, eager_lr) = jitted(x, y), (torch.manual_seed(100 + i),
                                                                  eager_step(x, y))[1]
            assert_close(loss, eager_loss)
            assert lr == eager_lr
    fallbacks = [str(w.message) for w in caught if "falls back to torch.compile" in str(w.message)]
    assert len(fallbacks) == 1 and "get_last_lr" in fallbacks[0] and \
        "after the learning-rate scheduler's step" in fallbacks[0], fallbacks
    _assert_same_training(model, optimizer, eager_model, eager_optimizer)
    assert scheduler.state_dict() == eager_scheduler.state_dict()


def _whole_step_pair(build, loss_of, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                     autocast: bool = False):
    """A model built twice alike, each with its optimizer and step function."""
    def one():
        model = build()
        opt = optimizer(model.parameters())

        def train_step(x, y):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = loss_of(model, x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            return loss.detach()
        return model, opt, train_step
    return one(), one()


def _train_both(pair, batches, fuse="off", rtol=None, atol=None):
    (model, optimizer, step), (eager_model, eager_optimizer, eager_step) = pair
    jitted = keraunos.jit(step, fuse=fuse, fallback="error")
    for x, y in batches:
        assert_close(jitted(x, y), eager_step(x, y), rtol=rtol, atol=atol)
    for (name, p), q in zip(model.named_parameters(), eager_model.parameters()):
        assert_close(p, q, rtol=rtol, atol=atol, msg=name)
        assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=name)
    return jitted


def test_a_litgpt_training_step_is_one_program_and_trains_like_eager():
    litgpt = pytest.importorskip("litgpt")
    config = litgpt.Config.from_name("Llama-2-7b-hf", n_layer=2, n_embd=64, n_head=4,
                                     n_query_groups=4, head_size=16, intermediate_size=176,
                                     vocab_size=128, padded_vocab_size=128, block_size=64)

    def build():
        torch.manual_seed(0)
        return litgpt.model.GPT(config)

    def loss_of(model, x, y):
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 128, (2, 16), generator=g),
                torch.randint(0, 128, (2, 16), generator=g)) for _ in range(4)]
    jitted = _train_both(_whole_step_pair(build, loss_of), batches, atol=2e-5, rtol=1e-4)
    assert "Backward in the program" in str(keraunos.last_traces(jitted)[-1])


def test_a_transformers_training_step_is_one_program_and_trains_like_eager():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)

    def build():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).train()

    def loss_of(model, x, y):
        return model(input_ids=x, labels=y).loss
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randint(0, 128, (2, 12), generator=g),) * 2 for _ in range(4)]
    _train_both(_whole_step_pair(build, loss_of), batches, atol=2e-5, rtol=1e-4)


def test_a_training_step_with_autocast_inside_trains_like_eager():
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(),
                                   torch.nn.Linear(32, 4))

    def loss_of(model, x, y):
        return F.cross_entropy(model(x), y)  # linear in bfloat16, the loss in float32
    batches = _batches(4)
    jitted = _train_both(_whole_step_pair(build, loss_of, autocast=True), batches)
    trace = str(keraunos.last_traces(jitted)[-1])
    assert "torch.bfloat16" in trace  # autocast's casts, lines of the program


def _update_regions(trace: str) -> tuple[list[str], list[str]]:
    """The headers of a fused step's regions of 0-dim values, and the lines outside regions
    that write a parameter or its state."""
    lines = trace.splitlines()
    scalars = [line for line in lines
               if line.lstrip().startswith("# inductor_region") and "(0-dim values)" in line]
    outside = [line for line in lines if not line.lstrip().startswith("#")
               and ("param_groups" in line or "state_values" in line)
               and ("_(" in line or ".copy_(" in line)]
    return scalars, outside


@pytest.mark.parametrize("precision", ["autocast", "bfloat16 weights"])
def test_a_fused_step_in_reduced_precision_updates_in_regions_and_trains_like_eager(precision):
    # Autocast switched off after the forward, and bfloat16 parameters (AdamW's step size, a
    # float32 0-dim tensor, is their ``addcdiv_``'s factor: computed in float32 as eager's
    # kernel does), must not leave the step counts or the updates a region per parameter.
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(),
                                    torch.nn.Linear(32, 4))
        return model.to(torch.bfloat16) if precision == "bfloat16 weights" else model

    def loss_of(model, x, y):
        return F.cross_entropy(model(x.to(model[0].weight.dtype)).float(), y)
    batches = _batches(4)
    tolerance = dict(rtol=2e-2, atol=2e-2) if precision == "bfloat16 weights" else {}
    jitted = _train_both(_whole_step_pair(build, loss_of, autocast=precision == "autocast"),
                         batches, fuse="wait", **tolerance)
    scalars, outside = _update_regions(str(keraunos.last_traces(jitted)[-1]))
    assert len(scalars) == 1 and "state_values_3_step_updated" in scalars[0], scalars
    assert not outside, outside


def test_a_scheduler_outside_with_a_tensor_rate_trains_like_eager_without_recompiling():
    def pair():
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2))
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.8)

        def train_step(x, y):
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            return loss
        return model, optimizer, scheduler, train_step
    model, optimizer, scheduler, step = pair()
    eager_model, eager_optimizer, eager_scheduler, eager_step = pair()
    jitted = keraunos.jit(step, fuse="off", fallback="error")
    for i, (x, y) in enumerate(_batches(6)):
        torch.manual_seed(i)
        got = jitted(x, y)
        torch.manual_seed(i)
        assert_close(got, eager_step(x, y))
        scheduler.step()
        eager_scheduler.step()
        if i == 2:
            misses = keraunos.cache_misses(jitted)
    assert keraunos.cache_misses(jitted) == misses  # the rate is read on every call
    _assert_same_training(model, optimizer, eager_model, eager_optimizer)
    assert_close(optimizer.param_groups[0]["lr"], eager_optimizer.param_groups[0]["lr"])


def test_the_step_shows_in_compile_stats_and_the_report(tmp_path):
    model, optimizer, step = _training("sgd")
    jitted = keraunos.jit(step, fuse="off", fallback="error")
    for x, y in _batches(3):
        jitted(x, y)
    stats = str(keraunos.compile_stats(jitted))
    assert "Backward in the program" in stats
    page = pathlib.Path(keraunos.report(jitted, tmp_path / "step.html")).read_text()
    assert "Backward in the program" in page and "nll_loss_backward" in page


@pytest.mark.parametrize("fuse", ["off", "wait"])
def test_peak_memory_of_a_step_is_at_most_eagers(fuse):
    """The gradients ``zero_grad(set_to_none=True)`` drops are freed where it runs, before the
    forward (the prologue checks them but hands them on no more), and a fused backward frees
    each saved activation at its last use (its region takes its inputs over): the step's peak
    memory, from the profiler's allocation records, is at most eager's."""
    from keraunos.testing.memory import peak_bytes

    def setup():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[m for _ in range(4) for m in (
            torch.nn.Linear(256, 256), torch.nn.GELU())], torch.nn.Linear(256, 8))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = torch.randn(128, 256), torch.randint(0, 8, (128,))

        def step():
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            return loss
        return model, step
    eager_model, eager_step = setup()
    model, step = setup()
    jitted = keraunos.jit(step, fuse=fuse)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert_close(jitted(), eager_step())
        eager, got = peak_bytes(eager_step), peak_bytes(jitted)
    _no_fallback(caught)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert_close(p, q)
    assert 0 < got <= eager * 1.01, (got, eager)  # (within a few small tensors)
    trace = str(keraunos.last_traces(jitted)[-1])
    assert ".grad = None" in trace.split("Backward in the program")[-1]  # in the computation


@pytest.mark.parametrize("fuse", ["off", "wait"])
def test_a_jitted_models_training_step_frees_saved_activations_as_eager_does(fuse):
    """``keraunos.jit(model)`` in an eager training loop: the backward trace takes its saved
    tensors over (autograd lets go of its copies) and deletes each at its last use, so the
    step's peak memory is at most eager's, where holding them all to the end of the backward
    would add the activations of every layer."""
    from keraunos.testing.memory import peak_bytes

    def setup(wrap):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[m for _ in range(6) for m in (
            torch.nn.Linear(256, 256), torch.nn.Tanh())], torch.nn.Linear(256, 8))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        x, y = torch.randn(512, 256), torch.randint(0, 8, (512,))
        runner = wrap(model)

        def step():
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(runner(x), y)
            loss.backward()
            optimizer.step()
            return loss.detach()
        return model, step
    eager_model, eager_step = setup(lambda m: m)
    model, step = setup(lambda m: keraunos.jit(m, fuse=fuse))
    for _ in range(3):
        assert_close(step(), eager_step())
    eager, got = peak_bytes(eager_step), peak_bytes(step)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert_close(p, q)
    assert 0 < got <= eager * 1.02, (got, eager)  # (within a tensor the size of the logits)


class _Trainer:
    """A training loop's object holding the model, its optimizer and scheduler."""

    def __init__(self):
        self.model = _model()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=10)

    def step(self, x, y):
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        return loss


def test_a_jitted_step_method_steps_the_scheduler_its_object_holds_like_eager():
    trainer, eager = _Trainer(), _Trainer()
    jitted = keraunos.jit(trainer.step, fallback="error")
    _run_both(jitted, eager.step, _batches(6))
    _assert_same_training(trainer.model, trainer.optimizer, eager.model, eager.optimizer)
    _assert_same_scheduler(trainer.scheduler, eager.scheduler)
    assert keraunos.cache_misses(jitted) == 3 and keraunos.cache_hits(jitted) == 3
