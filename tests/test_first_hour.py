"""What a new user meets in the first hour (issue 29): methods of a jitted module other than
``forward``, the interface a jitted module presents, the figures ``compile_stats`` prints, the
message for a NumPy argument and the command line's help. Every result is compared with eager.
"""
from __future__ import annotations

import inspect
import io
import re
import contextlib
import warnings

import numpy as np

import pytest
import torch

import keraunos


class Net(torch.nn.Module):
    """A model with the methods users add: one that calls ``self(...)``, one that calls
    ``self.forward(...)``, a generator, and one that never calls the model."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, scale: float = 1.0):
        return self.fc(x) * scale

    def predict(self, x):
        return self(x).argmax(-1)

    def probabilities(self, x):
        return self.forward(x).softmax(-1)

    def stream(self, batches):
        for x in batches:
            yield self(x)

    def describe(self):
        return f"Net with {sum(p.numel() for p in self.parameters())} parameters"


def _counts(jitted) -> tuple[int, int]:
    return keraunos.cache_hits(jitted), keraunos.cache_misses(jitted)


# ------------------------------------------------------------------------- the methods rule
def test_a_method_that_calls_self_runs_the_compiled_forward():
    model = Net()
    jmodel = keraunos.jit(model)
    x = torch.randn(5, 4)
    torch.testing.assert_close(jmodel.predict(x), model.predict(x))
    assert _counts(jmodel) == (0, 1)
    torch.testing.assert_close(jmodel.probabilities(x), model.probabilities(x))
    assert _counts(jmodel) == (1, 1)  # self.forward(x): the same entry
    torch.testing.assert_close(jmodel.predict(x), model.predict(x))
    assert _counts(jmodel) == (2, 1)
    assert jmodel.describe() == model.describe()  # no forward in it: nothing counted
    assert _counts(jmodel) == (2, 1)
    # Outside the method the original is untouched: calling it runs eagerly, uncounted.
    assert "forward" not in model.__dict__
    model.predict(x)
    assert _counts(jmodel) == (2, 1)


def test_a_generator_method_runs_each_step_through_the_compiled_forward():
    model = Net()
    jmodel = keraunos.jit(model)
    batches = [torch.randn(2, 4) for _ in range(3)]
    steps = jmodel.stream(batches)
    first = next(steps)
    assert "forward" not in model.__dict__  # between steps the original is itself
    rest = list(steps)
    for got, want in zip([first, *rest], model.stream(batches), strict=True):
        torch.testing.assert_close(got, want)
    assert _counts(jmodel) == (2, 1)


def test_a_method_of_a_module_with_hooks_runs_eagerly_and_says_so():
    model = Net()
    calls = []
    model.register_forward_hook(lambda module, args, out: calls.append(1))
    jmodel = keraunos.jit(model)
    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match=r"Net\.predict runs eagerly: the module has forward or "
                                          r"backward hooks"):
        got = jmodel.predict(x)
    torch.testing.assert_close(got, model.predict(x))
    assert calls == [1, 1]  # once per call, as eager: not twice
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per method
        jmodel.predict(x)
    assert _counts(jmodel) == (0, 0)


class SentenceEncoder(torch.nn.Module):
    """The shape of a sentence-transformer: ``encode`` batches and pads sentences, calls
    ``self.forward`` on a dict of features per batch and pools; batches differ in length."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, features: dict):
        hidden = self.layer(self.embed(features["input_ids"]))
        mask = features["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        return {"sentence_embedding": (hidden * mask).sum(1) / mask.sum(1)}

    def tokenize(self, sentences):
        ids = [[hash(w) % 50 for w in s.split()] for s in sentences]
        width = max(map(len, ids))
        return {"input_ids": torch.tensor([i + [0] * (width - len(i)) for i in ids]),
                "attention_mask": torch.tensor([[1] * len(i) + [0] * (width - len(i))
                                                for i in ids])}

    @torch.no_grad()
    def encode(self, sentences, batch_size: int = 2):
        out = [self.forward(self.tokenize(sentences[i:i + batch_size]))["sentence_embedding"]
               for i in range(0, len(sentences), batch_size)]
        return torch.cat(out)


def test_encode_of_a_sentence_encoder_hits_the_cache():
    model = SentenceEncoder().eval()
    jmodel = keraunos.jit(model)
    sentences = ["a b c", "d e", "f g h i", "j", "k l m n o", "p q", "r s t u", "v w"]
    torch.testing.assert_close(jmodel.encode(sentences), model.encode(sentences))
    hits, misses = _counts(jmodel)
    # Batches of 3, 4, 5 and 4 words: the second length recompiles once with it symbolic.
    assert misses == 2 and hits == 2, keraunos.last_cache_miss_reasons(jmodel)
    torch.testing.assert_close(jmodel.encode(sentences[::-1]), model.encode(sentences[::-1]))
    assert _counts(jmodel) == (6, 2)


# ----------------------------------------------------------------- the interface it presents
def test_jitted_module_presents_the_original_forward_signature():
    model = Net()
    jmodel = keraunos.jit(model)
    assert inspect.signature(jmodel.forward) == inspect.signature(model.forward)
    assert inspect.signature(jmodel) == inspect.signature(model.forward)  # better than eager's (*args, **kwargs)
    assert list(inspect.signature(type(jmodel).forward).parameters) == ["self", "x", "scale"]
    assert type(jmodel).__name__ == "Net" and isinstance(jmodel, keraunos.JittedModule)
    assert type(jmodel).__qualname__ == "JittedModule[Net]"
    # One class per original class, which each instance's native class (its own __call__,
    # the native hit path's Front) derives from.
    shared = [c for c in type(jmodel).__mro__ if c.__bases__ == (keraunos.JittedModule,)]
    assert len(shared) == 1 and isinstance(keraunos.jit(Net()), shared[0])
    x = torch.randn(2, 4)
    torch.testing.assert_close(jmodel.forward(x, scale=2.0), model(x, scale=2.0))


def test_a_module_with_its_own_forward_shows_that_forward():
    model = Net()
    model.forward = lambda x, y: model.fc(x) + y  # an instance's forward, not its class's
    jmodel = keraunos.jit(model)
    assert list(inspect.signature(jmodel.forward).parameters) == ["x", "y"]
    assert list(inspect.signature(keraunos.jit(Net()).forward).parameters) == ["x", "scale"]
    x, y = torch.randn(2, 4), torch.randn(2, 3)
    torch.testing.assert_close(jmodel(x, y), model.fc(x) + y)


def test_a_jitted_submodule_saves_and_loads_the_original_keys():
    torch.manual_seed(0)
    outer = torch.nn.Sequential(keraunos.jit(Net()), torch.nn.ReLU())
    eager = torch.nn.Sequential(Net(), torch.nn.ReLU())
    assert list(outer.state_dict()) == list(eager.state_dict()) == ["0.fc.weight", "0.fc.bias"]
    outer.load_state_dict(eager.state_dict())
    x = torch.randn(2, 4)
    torch.testing.assert_close(outer(x), eager(x))
    eager.load_state_dict({k: v * 2 for k, v in outer.state_dict().items()})  # and the reverse
    torch.testing.assert_close(eager[0].fc.weight, outer[0].fc.weight * 2)


# ------------------------------------------------------------------------ misuse messages
def test_a_numpy_array_argument_suggests_torch_from_numpy():
    model = torch.nn.Linear(3, 2)
    jmodel = keraunos.jit(model)
    array = np.ones((2, 3), dtype=np.float32)
    with pytest.raises(keraunos.UnsupportedInputError) as raised:
        jmodel(array)  # the line the message names
    message = str(raised.value)
    assert "args[0] is a numpy.ndarray" in message and "torch.from_numpy(array)" in message
    assert f"test_first_hour.py:" in message and "jmodel(array)" in message
    # What it suggests works, and gives eager's result.
    torch.testing.assert_close(jmodel(torch.from_numpy(array)), model(torch.from_numpy(array)))
    jf = keraunos.jit(lambda x, s: x * s)
    with pytest.raises(keraunos.UnsupportedInputError, match=r"numpy\.float32.*value\.item\(\)"):
        jf(torch.ones(2), np.float32(2.0))
    torch.testing.assert_close(jf(torch.ones(2), np.float32(2.0).item()), torch.ones(2) * 2.0)


# ------------------------------------------------------------------ compile_stats figures
def test_compile_stats_after_a_miss_and_after_a_hit():
    jf = keraunos.jit(lambda x: torch.tanh(x) * 2)
    x = torch.randn(3)
    torch.testing.assert_close(jf(x), torch.tanh(x) * 2)
    stats = keraunos.compile_stats(jf)
    assert stats.last_call_compiled
    assert 0 < stats.last_cache_lookup < stats.compile_time  # the lookup, not the compilation
    text = str(stats)
    assert "compile stages of the entry that ran last (ms):" in text
    assert "last call: a cache miss: no cached entry fitted (looking took " in text
    assert "calls so far: 0 cache hits, 1 cache miss (each miss compiles an entry)" in text
    torch.testing.assert_close(jf(x), torch.tanh(x) * 2)
    stats = keraunos.compile_stats(jf)
    assert not stats.last_call_compiled and stats.last_cache_lookup < stats.compile_time
    text = str(stats)
    assert "last call: a cache hit: the cache lookup (prologue checks) took " in text
    assert text.split("took ")[-1].split("\n")[0].endswith("us")
    assert "calls so far: 1 cache hit, 1 cache miss" in text


# ------------------------------------------------------------------------- the command line
def _bench():
    from keraunos import cli
    return cli._bench_script()


def test_bench_tiers_table_gives_ratios_to_regional_compile_and_dashes_where_nothing_fuses(capsys):
    from keraunos import cli
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", "tiers", "--help"])
    # (argparse wraps the list of systems where it likes: "regional-\n    async")
    assert done.value.code == 0 and "regional-async" in re.sub(r"-\s+", "-",
                                                              capsys.readouterr().out)
    tiers = cli._bench_script("tiers")
    row = {"first": 2.0, "fused": 4.0, "restart first": 1.0, "restart fused": 2.0, "call": 0.01}
    rows = {"regional": row, "keraunos": {**row, "first": 0.5, "call": 0.005},
            "eager": {**row, "call": 0.02}, "compile": None}
    text = tiers.table(rows, "title")
    lines = {line.split()[0]: line for line in text.splitlines()[2:]}
    assert "(ratios to regional torch.compile)" in text
    assert "0.50 s (0.25x)" in lines["keraunos"] and "5.0 ms (0.50x)" in lines["keraunos"]
    assert lines["eager"].split().count("-") == 2  # eager never fuses: no "fused" times
    assert "failed" in lines["compile"]
    del rows["regional"]
    rows["compile"] = row
    assert "(ratios to torch.compile)" in tiers.table(rows, "title")


def test_bench_help_says_what_each_workload_is(capsys):
    from keraunos import cli
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for workload in ("a  inference, overhead-bound", "b  inference, compute-bound",
                     "c  training: one step"):
        assert workload in text
    assert "pip install\n'keraunos[bench]'" in text or "pip install 'keraunos[bench]'" in text


def test_bench_without_litgpt_says_which_extra_to_install(monkeypatch, capsys):
    bench = _bench()
    monkeypatch.setattr(bench, "missing_requirements", lambda: ["litgpt"])
    assert bench.main(["--quick", "--workloads", "a", "--chart", ""]) == 2
    err = capsys.readouterr().err
    assert "litgpt is not installed: pip install 'keraunos[bench]'" in err


def test_bench_table_shows_no_compile_time_for_eager():
    bench = _bench()
    run = dict(compile=-0.01, median=0.01, first=0.01, peak=2**20, peak_over_setup=0, saved=None,
               diff=0.0)
    rows = [dict(workload="a", system="eager", cold=run, warm=None),
            dict(workload="a", system="keraunos", cold=dict(run, compile=0.5, median=0.005),
                 warm=dict(run, compile=0.2, median=0.005))]
    text = bench.table(rows)
    eager_line = next(line for line in text.splitlines() if line.strip().startswith("eager"))
    assert "-0.01" not in eager_line and eager_line.split()[1] == "-"
    rows[1]["warm"]["compile"] = -0.2  # a warm compile below the timing noise
    assert "~0 s" in bench.table(rows) and "-0.2" not in bench.table(rows)
    assert "0.50 s" in text and "0.50x" in text  # keraunos: its compile, half eager's per call
    assert "columns: compile cold / warm: compile + warm-up in seconds" in text


def test_cli_run_labels_when_its_cache_counters_were_read(capsys):
    from keraunos import cli
    assert cli.main(["run", "--layers", "1", "--width", "32", "--calls", "5"]) == 0
    out = capsys.readouterr().out
    after_first = out.split("after the first call")[1].split("per-call time")[0]
    assert "calls so far: 0 cache hits, 1 cache miss" in after_first
    assert "last call: a cache miss" in after_first
    total = 2 + cli.WARMUP + 5  # the first call, the one after the switch, warm-up, timed
    assert (f"cache, after all {total} calls of the jitted model: {total - 1} hits, 1 miss "
            f"(the first call, which compiled; the switch to the fused tier is no miss)") in out
    assert "us per call" in out


def test_the_compilation_log_numbers_entries_not_what_became_symbolic():
    from keraunos import debug
    from keraunos.runtime.call import state_of
    jf = keraunos.jit(lambda x: x.exp() - 1)
    for n in (2, 5):
        x = torch.randn(n)
        torch.testing.assert_close(jf(x), x.exp() - 1)
    record = debug.compilations(state_of(jf))[-1]
    text = debug.describe("f", record)
    assert "    entry 0: check failed: tensor 'args[0]' size mismatch at index 0" in text
    assert "    so: args[0] dimension 0 changed 2 → 5; recompiled with it symbolic" in text
    assert "entry 1" not in text  # there was one cached entry
