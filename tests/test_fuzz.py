"""The differential fuzzer: generated programs agree with eager, and the checker itself can fail.

``test_fixed_seeds_agree_with_eager`` runs a fixed set of generated programs (functions and
modules driven through calls and state changes) and asserts that none disagrees with eager and
none raises an internal error; its failure message carries shrunk, runnable reproducers.
``test_back_to_back_with_fusion_in_the_background`` runs programs one after another in one
process on the default tier (each program's fused compile overlapping the next programs, the
eager steps under ``warnings.simplefilter("error")``), with the default threshold for fusion and
with every program fused. The other tests plant bugs in the "jitted" side to show that each
comparison can fail, that a background compile's leaks are caught, and that the shrinker shrinks.
"""
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from torch.utils import _pytree as pytree

import keraunos
from keraunos.testing.fuzz import Call, Change, Program, generate, run_program, shrink
from keraunos.testing.fuzz.campaign import run_campaign

CI_PROGRAMS = int(os.environ.get("KERAUNOS_FUZZ_PROGRAMS", "160"))
BACK_TO_BACK_PROGRAMS = int(os.environ.get("KERAUNOS_FUZZ_BACK_TO_BACK_PROGRAMS", "80"))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's keraunos


# The fixed seeds in four parts (every fourth name), so that the run spreads them over its
# workers: all 160 in one test took one worker for tens of seconds.
PARTS = 4


@pytest.mark.long
@pytest.mark.parametrize("part", range(PARTS))
def test_fixed_seeds_agree_with_eager(part):
    names = [f"ci:{i}" for i in range(CI_PROGRAMS)][part::PARTS]
    report = run_campaign(names, shrink_budget=20.0, per_kind=1)
    outcomes = report.outcomes.values()
    refused = sum(o.status == "refusal" for o in outcomes)
    compared = sum(o.calls for o in outcomes)
    assert not report.failures, report.summary() + "\n\n" + report.reproducers_text()
    # A fuzzer whose programs are all refused or all invalid tests nothing.
    assert refused <= len(names) // 5, report.summary()
    assert compared >= 2 * len(names), report.summary()


def _counts(summary: str) -> dict[str, int]:
    return {status: int(n) for status, n in re.findall(r"^\s+([a-z ]+): (\d+)$", summary, re.M)}


@pytest.mark.long
@pytest.mark.parametrize("min_fused_ops", [None, 1], ids=["default", "min-fused-ops-1"])
def test_back_to_back_with_fusion_in_the_background(min_fused_ops):
    """``python -m keraunos.testing.fuzz --back-to-back`` in a process of its own (its fused
    compiles still under way end with it): no mismatch, no internal error (which includes the
    process state seen by the programs' thread changing, and a fused tier failing to compile),
    few refusals, and calls compared. ``min_fused_ops=1``: nearly every program is fused."""
    command = [sys.executable, "-m", "keraunos.testing.fuzz", "--back-to-back", "--seed", "17",
               "--programs", str(BACK_TO_BACK_PROGRAMS), "--per-kind", "1"]
    if min_fused_ops is not None:
        command += ["--min-fused-ops", str(min_fused_ops)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("KERAUNOS_FUSE", None)  # the default tier
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    summary = done.stdout.split("\n# =====")[0]
    counts = _counts(summary)
    assert "pass" in counts and "internal error" in counts, done.stdout[-4000:] + done.stderr[-4000:]
    assert counts["mismatch"] == 0 and counts["internal error"] == 0, \
        summary + "\n# =====" + done.stdout[len(summary):][:6000]
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert counts["refusal"] <= BACK_TO_BACK_PROGRAMS // 5, summary
    compared = int(re.search(r"(\d+) calls compared", summary).group(1))
    assert compared >= 2 * BACK_TO_BACK_PROGRAMS, summary


# ------------------------------------------------------------------ the checker can fail
def _program(body, returns, structure="tuple", steps=None, params=("a",)) -> Program:
    steps = steps or (Call("a = torch.randn(3, D)", 1, ("a",)),
                      Call("L = torch.randn(3, D).requires_grad_()\na = L.clone()", 2, ("a",)))
    return Program(name="planted", kind="function", params=params, header=(), sub_init=(),
                   sub_body=(), init=(), body=tuple(body), returns=tuple(returns),
                   structure=structure, steps=tuple(steps))


def _outputs_map(fn):
    """A planted "compiler": runs the function eagerly, then applies ``fn`` to each output."""
    def make(f):
        def wrapped(*args, **kwargs):
            return pytree.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x,
                                   f(*args, **kwargs))
        return wrapped
    return make


def test_eager_against_itself_passes():
    outcome = run_program(_program(["a.add_(1.0)", "t = a * 2"], ["a", "t", "a[1:]", "None"]),
                          make_jitted=lambda f: f)
    assert outcome.status == "pass" and outcome.calls == 2, outcome


def test_planted_wrong_value_is_a_mismatch():
    outcome = run_program(_program(["t = a * 2"], ["t"]),
                          make_jitted=_outputs_map(lambda t: t + 0.01))
    assert (outcome.status, outcome.check) == ("mismatch", "output value"), outcome


def test_planted_new_object_for_returned_input_is_an_identity_mismatch():
    outcome = run_program(_program(["a.add_(1.0)"], ["a"]),
                          make_jitted=_outputs_map(lambda t: t.view_as(t)))
    assert (outcome.status, outcome.check) == ("mismatch", "output identity"), outcome


def test_planted_copy_of_returned_view_is_an_aliasing_mismatch():
    outcome = run_program(_program([], ["a[1:]"]), make_jitted=_outputs_map(torch.clone))
    assert (outcome.status, outcome.check) == ("mismatch", "output aliasing"), outcome


def test_planted_lost_inplace_write_is_an_input_mismatch():
    def on_copies(f):
        return lambda *args: f(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])

    outcome = run_program(_program(["a.mul_(3.0)"], ["a.sum()"]), make_jitted=on_copies)
    assert (outcome.status, outcome.check) == ("mismatch", "input after the call value"), outcome


def test_planted_detached_output_is_a_requires_grad_mismatch():
    outcome = run_program(_program(["t = a * 2"], ["t"]),
                          make_jitted=_outputs_map(torch.Tensor.detach))
    assert outcome.status == "mismatch" and outcome.step == 1, outcome
    assert outcome.check == "output requires_grad", outcome


def test_planted_wrong_gradient_is_a_gradient_mismatch():
    class Doubled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    outcome = run_program(_program(["t = a * 2"], ["t"]), make_jitted=_outputs_map(Doubled.apply))
    assert (outcome.status, outcome.check) == ("mismatch", "gradient after backward value"), outcome


def test_planted_stale_module_state_is_a_module_mismatch():
    program = Program(
        name="planted", kind="module", params=("a",), header=(), sub_init=(), sub_body=(),
        init=("self.register_buffer('buf', torch.zeros(D))",), body=("self.buf.add_(1.0)",),
        returns=("a * 2",), structure="single",
        steps=(Call("a = torch.randn(2, D)", 1, ("a",)),))

    def on_copy(model):
        import copy
        return copy.deepcopy(model)

    outcome = run_program(program, make_jitted=on_copy)
    assert (outcome.status, outcome.check) == ("mismatch", "module after the call value"), outcome


def test_unexpected_exception_is_an_internal_error_and_capture_error_a_refusal():
    def raising(exc):
        def make(f):
            def wrapped(*args, **kwargs):
                raise exc
            return wrapped
        return make

    program = _program(["t = a * 2"], ["t"])
    crashed = run_program(program, make_jitted=raising(ValueError("boom")))
    assert crashed.status == "internal error" and "ValueError" in crashed.check, crashed
    refused = run_program(program, make_jitted=raising(keraunos.CaptureError("no can do")))
    assert (refused.status, refused.check) == ("refusal", "no can do"), refused


def test_jit_that_does_not_raise_where_eager_does_is_an_internal_error():
    program = _program(["t = a @ a"], ["t"])  # (3, 4) @ (3, 4): eager raises
    outcome = run_program(program, make_jitted=lambda f: (lambda *a: torch.zeros(3)))
    assert outcome.status == "internal error" and "eager raised RuntimeError" in outcome.check


# ------------------------------------------- back to back: what the harness itself catches
from keraunos.testing.fuzz.campaign import BackToBack, Report, warnings_as_errors  # noqa: E402


def _back_to_back_outcome(program, make_jitted):
    """``program`` through ``BackToBack`` (as ``--back-to-back`` runs each program) with a
    planted "compiler"."""
    runner = BackToBack(Report(), compile_reference=False, make_jitted=make_jitted)
    return runner.run(program.name, program)


def test_eager_steps_alone_run_with_warnings_as_errors():
    """An eager step that warns raises under the guard and ends the program (a pass: the
    jitted side, never guarded, cannot be compared past it); a jitted call that raises a
    warning as an error, where eager did not warn, is an internal error."""
    warns = _program(["__import__('warnings').warn('careful')", "t = a * 2"], ["t"])
    outcome = run_program(warns, make_jitted=lambda f: f, eager_guard=warnings_as_errors)
    assert outcome.status == "pass" and "eager warned (UserWarning: careful)" in outcome.ended_by_error
    assert run_program(warns, make_jitted=lambda f: f).ended_by_error == ""  # unguarded: no stop

    def raising_warning(f):
        def wrapped(*args):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # as if an "error" filter had leaked to it
                warnings.warn("leaked filter")
            return f(*args)
        return wrapped

    quiet = _program(["t = a * 2"], ["t"])
    outcome = run_program(quiet, make_jitted=raising_warning, eager_guard=warnings_as_errors)
    assert outcome.status == "internal error" and "UserWarning" in outcome.check, outcome


def test_back_to_back_reports_a_process_state_change():
    """A "compiler" whose second call leaves a warnings filter and a patched ``nn.Module``
    method behind (as a compile on another thread that swaps them would) fails the program
    ("process state changed", naming both); the next program starts from the state before."""
    original_call = torch.nn.Module.__call__
    filters = list(warnings.filters)

    def leaking(f):
        calls = []

        def wrapped(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                warnings.filterwarnings("ignore", "planted")
                torch.nn.Module.__call__ = lambda self, *a, **k: original_call(self, *a, **k)
            return f(*args, **kwargs)
        return wrapped

    try:
        outcome = _back_to_back_outcome(_program(["t = a * 2"], ["t"]), leaking)
        assert outcome.status == "internal error", outcome
        assert "warnings.filters" in outcome.check and "class dicts" in outcome.check, outcome
        assert "Module.__call__" in outcome.detail and "planted" in outcome.detail, outcome
        assert warnings.filters == filters
    finally:
        torch.nn.Module.__call__ = original_call
    clean = _back_to_back_outcome(_program(["t = a * 2"], ["t"]), lambda f: f)
    assert clean.status == "pass" and clean.calls == 2, clean


# ---------------------------------------------------------------------------- the rest
def test_generation_is_deterministic_and_diverse():
    assert generate("0:7") == generate("0:7")
    sources = {generate(f"0:{i}").source for i in range(20)}
    kinds = {generate(f"0:{i}").kind for i in range(20)}
    assert len(sources) == 20 and kinds == {"function", "module"}


def test_shrinker_keeps_the_failure_and_drops_the_rest():
    program = generate("0:3")
    program = program.with_(steps=program.steps + tuple(
        Change("G['UNUSED'] = 1", 9) for _ in range(3)))
    planted = _outputs_map(lambda t: t + 1.0 if t.is_floating_point() else t)
    outcome = run_program(program, make_jitted=planted)
    assert outcome.status == "mismatch", outcome
    small, small_outcome = shrink(program, outcome, run=lambda p: run_program(p, planted),
                                  budget_s=60)
    assert small_outcome.signature == outcome.signature
    assert len(small.steps) == 1 and len(small.body) < max(len(program.body), 1)
    assert len(small.source) < len(program.source)
    namespace = {}
    exec(compile(small.reproducer(str(small_outcome)), "reproducer", "exec"), namespace)
    assert namespace["program"] == small  # the printed reproducer rebuilds the same program


@pytest.mark.parametrize("name", ["0:0", "0:1"])
def test_reproducer_is_runnable(name, capsys):
    script = generate(name).reproducer("example")
    exec(compile(script, "reproducer", "exec"), {})
    assert capsys.readouterr().out.split()[0] in ("pass", "mismatch", "rounding", "internal",
                                                  "refusal")


# ----------------------------------------------- float mismatches: wrong result or rounding
from keraunos.testing.fuzz.classify import Promote, Record, judge  # noqa: E402


def _in_float64(f):
    """A planted "compiler" more accurate than eager: computes in float64, rounds the outputs."""
    def wrapped(*args):
        out = f(*[a.double() if isinstance(a, torch.Tensor) else a for a in args])
        return pytree.tree_map(lambda x: x.float() if isinstance(x, torch.Tensor) else x, out)
    return wrapped


def _cancelling(body_result="t"):
    # a * 1e6 + 0.3 - a * 1e6 is 0.3 in float64; float32 keeps ~1/16 of it (ulp of 1e6)
    return _program(["t = (a * 1e6 + 0.3) - a * 1e6"], [body_result])


def test_accurate_jit_of_an_ill_conditioned_program_is_rounding_with_its_evidence():
    outcome = run_program(_cancelling(), make_jitted=_in_float64)
    assert (outcome.status, outcome.check) == ("rounding", "output value"), outcome
    assert "max |eager f32 - f64| = " in outcome.detail and "max |jit - f64| = " in outcome.detail


def test_a_wrong_value_of_an_ill_conditioned_program_stays_a_mismatch():
    wrong = _in_float64(lambda a: ((a * 1e6 + 0.3) - a * 1e6 + 10.0,))
    outcome = run_program(_cancelling(), make_jitted=lambda f: wrong)
    assert (outcome.status, outcome.check) == ("mismatch", "output value"), outcome
    assert "not rounding" in outcome.detail, outcome


@pytest.mark.parametrize("plant, check", [
    (lambda: (_program(["t = a * 2"], ["t"]), _outputs_map(lambda t: t + 0.01)), "output value"),
    (lambda: (_program(["t = a * 2"], ["t"]), _outputs_map(lambda t: t * (1 + 1e-3))),
     "output value")])
def test_planted_wrong_values_are_judged_and_stay_mismatches(plant, check):
    program, make = plant()
    outcome = run_program(program, make_jitted=make)
    assert (outcome.status, outcome.check) == ("mismatch", check), outcome
    # the classifier ran (eager float32 is float64's to an ulp) and said why it is no rounding
    assert "not rounding: against float64 eager" in outcome.detail, outcome


def test_judge_accepts_a_jit_value_closer_to_float64_than_eager():
    exact = torch.tensor([1000.3, -2.0, 5.0], dtype=torch.float64)
    eager = torch.tensor([1000.0, -2.0, 5.0])       # eager lost 0.3 (cancellation)
    jitted = torch.tensor([1000.25, -2.0, 5.0])     # closer, but not eager's
    assert judge(eager, jitted, exact)[0]
    assert not judge(eager, torch.tensor([1003.5, -2.0, 5.0]), exact)[0]  # > 10 x eager's error


def test_judge_rejects_a_wrong_value_where_eager_is_accurate():
    exact = torch.linspace(-3, 3, 12, dtype=torch.float64)
    eager = exact.float()
    rounding, evidence = judge(eager, eager + 1e-3, exact)
    assert not rounding and "max |jit - f64| = 0.001" in evidence
    assert judge(eager, exact.float(), exact)[0]  # float64's own value rounded: accepted


def test_judge_with_fusion_accepts_torch_compiles_value_and_only_it():
    exact = torch.tensor([1.0, 2.0], dtype=torch.float64)
    eager = torch.tensor([1.0, 2.0])
    fused = torch.tensor([1.5, 2.0])
    assert not judge(eager, fused, exact)[0]
    rounding, evidence = judge(eager, fused, exact, compiled=fused.clone())
    assert rounding and "jit equals torch.compile's" in evidence
    assert not judge(eager, fused, exact, compiled=torch.tensor([1.2, 2.0]))[0]


def test_judge_non_finite_values_must_be_float64s_or_eagers():
    exact = torch.tensor([1e39, 1.0], dtype=torch.float64)
    eager = torch.tensor([float("inf"), 1.0])       # float32 overflows where float64 does not
    assert judge(eager, torch.tensor([float("inf"), 1.0]), exact)[0]
    assert not judge(eager, torch.tensor([float("nan"), 1.0]), exact)[0]
    assert not judge(eager, torch.tensor([float("inf"), float("nan")]), exact)[0]


def test_float64_replay_draws_eagers_numbers_keeps_narrow_rounding_and_dtype_branches():
    def f(a):
        if a.dtype == torch.float64:   # eager saw float32: the float64 run must branch alike
            return a * 0
        x = torch.randn(3, 4) + torch.nn.init.uniform_(torch.empty(4))
        return (a + x).to(torch.bfloat16).float(), a.double() * 3

    torch.manual_seed(5)
    a = torch.randn(3, 4)
    record = Record()
    torch.manual_seed(6)
    with record:
        eager = f(a)
    a64 = a.double()  # what the classifier's factories make of the program's float32 input
    torch.manual_seed(6)
    with Promote(record.facts):
        exact = f(a64)
    assert [t.dtype for t in exact] == [torch.float64, torch.float64]
    assert torch.equal(exact[0], eager[0].double())  # same draws, same bfloat16 rounding
    assert torch.equal(exact[1], eager[1])


def test_a_float64_run_that_does_another_thing_is_refused():
    record = Record()
    with record:
        torch.ones(2).sin()
    with pytest.raises(Exception, match="eager called"):
        with Promote(record.facts):
            torch.ones(2).cos()


def test_autocast_mode_runs_both_sides_under_autocast_and_is_undone():
    """``--autocast bfloat16``: every step of both sides runs under ``torch.autocast``, so a
    compiler that drops autocast's casts (an output in float32 where eager's matmul gives
    bfloat16) is a mismatch, which it is not without autocast; a campaign leaves the fuzzer's
    settings as they were."""
    from keraunos.testing.fuzz import compare, side as drive
    from keraunos.testing.fuzz.campaign import use_autocast
    program = _program(["t = a @ a.T"], ["t"])
    to_float32 = _outputs_map(lambda t: t.float())
    assert run_program(program, make_jitted=to_float32).status == "pass"
    before = compare.RTOL, compare.ATOL, drive.AMBIENT
    use_autocast("bfloat16")
    try:
        outcome = run_program(program, make_jitted=to_float32)
        assert outcome.status == "mismatch", outcome
        assert run_program(program, make_jitted=lambda f: f).status == "pass"
    finally:
        compare.RTOL, compare.ATOL, drive.AMBIENT = before
    report = run_campaign([f"3:{i}" for i in range(12)], shrink_budget=0, autocast="bfloat16")
    assert not report.failures, report.summary()
    assert any("torch.autocast('cpu', dtype=torch.bfloat16)" in n for n in report.notes)
    assert (compare.RTOL, compare.ATOL, drive.AMBIENT) == before
