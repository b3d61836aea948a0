"""print, logging and warnings.warn inside a jitted program run on every call, with eager's text."""
import functools
import logging
import warnings

import pytest
import torch

import keraunos
from keraunos.errors import DataDependentError

log = logging.getLogger("keraunos.tests.program")


def _outputs_per_call(fn, capsys, make_inputs, calls=3):
    texts = []
    for i in range(calls):
        fn(*make_inputs(i))
        texts.append(capsys.readouterr().out)
    return texts


def test_print_runs_on_every_call_with_eagers_text(capsys):
    def f(x, n):
        y = x * 2
        print("y is", y, "n", n, y.shape, sep=" | ")
        y.add_(1)  # after the print: the printed values are those before the write
        print([y, n], {"sum": y.sum()}, end="!\n")
        return y

    def inputs(i):
        return torch.arange(3.0) + i, 5

    expected = _outputs_per_call(f, capsys, inputs)
    jitted = keraunos.jit(f)
    assert _outputs_per_call(jitted, capsys, inputs) == expected
    assert keraunos.cache_hits(jitted) == 2


def test_printed_tensors_show_eagers_autograd_suffix(capsys):
    weight = torch.nn.Parameter(torch.ones(2))

    def f(x):
        y = x * weight
        print(y, weight, x)
        return y.sum()

    def inputs(i):
        return (torch.full((2,), float(i), requires_grad=True),)

    expected = _outputs_per_call(f, capsys, inputs)
    assert "grad_fn=<MulBackward0>" in expected[0] and "Parameter containing" in expected[0]
    assert _outputs_per_call(keraunos.jit(f), capsys, inputs) == expected


def test_print_in_a_module_forward_and_a_helper(capsys):
    def report(name, t):
        print(name, t.mean())

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.fc = torch.nn.Linear(3, 2)

        def forward(self, x):
            h = self.fc(x)
            report("h", h)
            return h.relu()

    model = M()

    def inputs(i):
        torch.manual_seed(i)
        return (torch.randn(4, 3),)

    expected = _outputs_per_call(model, capsys, inputs)
    assert _outputs_per_call(keraunos.jit(model), capsys, inputs) == expected


def _records(caplog, fn, make_inputs, calls=3):
    caplog.clear()
    for i in range(calls):
        fn(*make_inputs(i))
    return [(r.levelname, r.getMessage(), r.filename, r.lineno, r.funcName)
            for r in caplog.records if r.name == log.name]


def test_logging_runs_on_every_call_with_eagers_record(caplog):
    def f(x):
        y = x.sin()
        log.info("sum %s of %d values", y.sum(), y.numel())
        log.warning("max is %s", y.max())
        logging.getLogger(log.name).log(logging.ERROR, "done")
        return y

    def inputs(i):
        return (torch.arange(4.0) * i,)

    caplog.set_level(logging.INFO, logger=log.name)
    expected = _records(caplog, f, inputs)
    assert len(expected) == 9
    assert _records(caplog, keraunos.jit(f), inputs) == expected


def test_a_log_level_changed_after_compiling_is_followed(caplog):
    def f(x):
        log.debug("x %s", x)
        return x + 1

    jitted = keraunos.jit(f)
    caplog.set_level(logging.WARNING, logger=log.name)
    jitted(torch.ones(2))
    assert not [r for r in caplog.records if r.name == log.name]
    caplog.set_level(logging.DEBUG, logger=log.name)
    jitted(torch.ones(2))
    assert [r.getMessage() for r in caplog.records if r.name == log.name] == ["x tensor([1., 1.])"]
    assert keraunos.cache_misses(jitted) == 1


def test_a_once_logging_helper_logs_once_as_in_eager(caplog):
    def make():
        @functools.lru_cache(None)
        def warning_once(message):  # the shape of transformers' logger.warning_once
            log.warning(message)

        def f(x):
            warning_once("note")
            return x * 3
        return f

    caplog.set_level(logging.WARNING, logger=log.name)
    counts = []
    for wrap in (lambda f: f, keraunos.jit):
        caplog.clear()
        run = wrap(make())
        for _ in range(3):
            run(torch.ones(2))
        counts.append([r.getMessage() for r in caplog.records if r.name == log.name])
    assert counts[0] == counts[1] == ["note"]


def _warnings(fn, make_inputs, action, calls=3):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter(action)
        for i in range(calls):
            fn(*make_inputs(i))
    return [(w.category, str(w.message), w.filename, w.lineno) for w in caught
            if "careful" in str(w.message)]


@pytest.mark.parametrize("action", ["always", "default"])
def test_warnings_warn_follows_the_filters_as_in_eager(action):
    def f(x):
        warnings.warn("careful: x is large", RuntimeWarning)
        return x * 2

    def inputs(i):
        return (torch.ones(2) * i,)

    # A fresh location registry for each: "default" warns once per location.
    f.__globals__.pop("__warningregistry__", None)
    expected = _warnings(f, inputs, action)
    f.__globals__.pop("__warningregistry__", None)
    assert _warnings(keraunos.jit(f), inputs, action) == expected
    assert len(expected) == (3 if action == "always" else 1)


def test_warning_as_error_raises_on_every_call_as_in_eager():
    def f(x):
        warnings.warn("careful")
        return x * 2

    jitted = keraunos.jit(f)
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(UserWarning, match="careful"):
                jitted(torch.ones(2))


def test_formatting_tensor_values_into_text_is_data_dependent():
    def f(x):
        print(f"x = {x}")
        return x * 2

    with pytest.raises(DataDependentError, match="formats a tensor's values as text"):
        keraunos.jit(f, fallback="error")(torch.ones(2))


def test_formatting_shapes_and_dtypes_is_not_data_dependent(capsys):
    def f(x):
        print(f"shape {x.shape}, dtype {x.dtype}")
        return x * 2

    jitted = keraunos.jit(f)
    for n in (2, 2, 3):
        jitted(torch.ones(n))
        expected = f"shape {torch.Size([n])}, dtype torch.float32\n"
        assert capsys.readouterr().out == expected


def test_printed_symbolic_sizes_show_each_calls_value(capsys):
    def f(x):
        print("rows", x.shape[0], x.shape, x.shape[0] * 2)
        return x * 2

    def inputs(i):
        return (torch.ones(2 + i, 3),)

    expected = _outputs_per_call(f, capsys, inputs, calls=4)
    jitted = keraunos.jit(f)
    assert _outputs_per_call(jitted, capsys, inputs, calls=4) == expected
    # The second size recompiles with it symbolic; that entry serves the later sizes.
    assert keraunos.cache_misses(jitted) == 2 and keraunos.cache_hits(jitted) == 2
