"""A program that runs autograd's backward itself (a training step written as one function:
``loss.backward()``, clipping, the optimizer, a scheduler; or ``torch.autograd.grad``) against
eager PyTorch. Capture refuses the backward by name (``BackwardInProgramError``); by default
the step takes the fallback route with one warning naming the line, and leaves what eager
leaves: the loss, parameters, ``.grad``, optimizer state and the scheduler's learning rate."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import keraunos
from keraunos.errors import BackwardInProgramError


def _training(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

    def train_step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        return loss
    return model, optimizer, scheduler, train_step


def test_a_whole_training_step_falls_back_once_naming_the_backward_and_trains_like_eager():
    model, optimizer, scheduler, step = _training()
    eager_model, eager_optimizer, eager_scheduler, eager_step = _training()
    jitted = keraunos.jit(step)
    torch.manual_seed(1)
    batches = [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches:
            assert_close(jitted(x, y), eager_step(x, y))
    fallbacks = [str(w.message) for w in caught if "falls back to torch.compile" in str(w.message)]
    assert len(fallbacks) == 1, fallbacks
    assert "loss.backward()" in fallbacks[0] and "What to do" in fallbacks[0]
    for (name, p), q in zip(model.named_parameters(), eager_model.parameters()):
        assert_close(p, q, msg=name)
        assert_close(p.grad, q.grad, msg=name)
        state, eager_state = optimizer.state[p], eager_optimizer.state[q]
        assert_close(state["step"], eager_state["step"])
        assert_close(state["exp_avg"], eager_state["exp_avg"])
        assert_close(state["exp_avg_sq"], eager_state["exp_avg_sq"])
    assert scheduler.get_last_lr() == eager_scheduler.get_last_lr()
    assert scheduler.last_epoch == eager_scheduler.last_epoch == 4


def test_fallback_error_names_the_backward_and_leaves_the_model_as_it_was():
    model, optimizer, _, step = _training()
    before = copy.deepcopy(model.state_dict())
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    with pytest.raises(BackwardInProgramError, match=r"loss\.backward\(\)(.|\n)*What to do"):
        keraunos.jit(step, fallback="error")(x, y)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert all(p.grad is None for p in model.parameters())
    assert not optimizer.state


def _weight():
    torch.manual_seed(2)
    return torch.randn(4, 4, requires_grad=True)


@pytest.mark.parametrize("how", ["backward", "autograd.grad", "autograd.backward"])
def test_a_backward_inside_the_program_gives_eagers_result_and_gradients(how):
    w, eager_w = _weight(), _weight()

    def program(x, w=w):
        y = (x @ w).tanh().sum()
        if how == "autograd.grad":
            return torch.autograd.grad(y, w)[0]
        if how == "backward":
            y.backward()
        else:
            torch.autograd.backward([y])
        return y.detach()

    x = torch.randn(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one fallback warning, checked above
        got = keraunos.jit(program)(x)
    want = program(x, eager_w)
    assert_close(got, want)
    if how == "autograd.grad":
        assert w.grad is None and eager_w.grad is None
    else:
        assert_close(w.grad, eager_w.grad)
