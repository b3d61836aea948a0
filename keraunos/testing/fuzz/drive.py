"""Running a program on two sides, the jitted one and its eager twin, and comparing after each step.

Both sides execute the program's source in their own globals (so a change to a global read by a
helper happens on each side), build the module under the same seed, and run every step after the
same ``torch.manual_seed``. After each call the driver compares outputs, the inputs (in-place
effects), the module's parameters, buffers and attributes, the program's globals, and, after a
backward of the sum of the outputs that require grad, the gradients.
"""
from __future__ import annotations

import linecache
import re
import traceback
import warnings
from typing import Callable, ContextManager

import torch

import keraunos

from .classify import classify_mismatch
from .compare import Mismatch, compare_roles, compare_states, compare_tree, flatten, module_state
from .program import Call, Program
from .side import Outcome, Side, ambient, backward_one, call_one, globals_of, grad_outputs


class _Stop(Exception):
    """Ends a program: ``outcome`` is None when both sides raised alike (nothing to compare)."""

    def __init__(self, outcome: Outcome | None, ended_by_error: str = ""):
        self.outcome = outcome
        self.ended_by_error = ended_by_error


def run_program(program: Program, make_jitted: Callable = keraunos.jit, classify: bool = True,
                compile_reference: bool = False, after_call: Callable | None = None,
                eager_guard: Callable[[], ContextManager] | None = None) -> Outcome:
    """Drive ``program`` through its steps on ``make_jitted(f_or_model)`` and on the eager twin.
    ``classify``: a float value mismatch is checked against float64 eager (and, with
    ``compile_reference``, against ``torch.compile``) and becomes "rounding" when the jitted value
    is as good as eager's (``classify.py``). ``after_call(jitted)`` runs after each compared call
    (``--fuse background``: wait for the fused tier, so that the next calls run it).
    ``eager_guard()``: a context entered around each step of the eager side only (its calls,
    state changes and backwards), never around the jitted side's (``--back-to-back``: warnings
    made errors, as a test harness does). A warning raised as an error there ends the program as
    a pass: the jitted side ran without that filter, so the two cannot be compared further."""
    filename = f"keraunos_fuzz_{re.sub(r'[^0-9A-Za-z]', '_', program.name)}.py"
    source = program.source
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    grad_mode = torch.is_grad_enabled()
    calls = 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                eager = Side(program, filename, None)
            except Exception as e:  # noqa: BLE001 - an invalid program (the shrinker makes some)
                return Outcome("pass", ended_by_error=f"build: {type(e).__name__}: {_first_line(e)}")
            jitted = _two(lambda: Side(program, filename, make_jitted))
            for index, step in enumerate(program.steps):
                try:
                    if isinstance(step, Call):
                        _call(step, eager, jitted, eager_guard)
                        calls += 1
                        if after_call is not None:
                            after_call(jitted.target)
                    else:
                        _both(lambda side: exec(step.render(), side.env()), eager, jitted, "change",
                              eager_guard)
                except Mismatch as m:
                    outcome = Outcome("mismatch", m.check, m.detail, index, calls)
                    if classify and m.eager is not None:
                        outcome = classify_mismatch(program, filename, outcome, m,
                                                    compile_reference)
                    return outcome
                except _Stop as stop:
                    if stop.outcome is None:
                        return Outcome("pass", step=index, calls=calls, ended_by_error=stop.ended_by_error)
                    stop.outcome.step, stop.outcome.calls = index, calls
                    return stop.outcome
                except Exception as e:  # noqa: BLE001 - the comparison itself failed: never a pass
                    return Outcome("internal error", f"fuzzer comparison raised {type(e).__name__}",
                                   _first_line(e), index, calls)
    except _Stop as stop:  # the program itself does not build
        return stop.outcome or Outcome("pass", ended_by_error=stop.ended_by_error)
    finally:
        torch.set_grad_enabled(grad_mode)
        linecache.cache.pop(filename, None)
    return Outcome("pass", calls=calls)


def _two(make):
    try:
        return make()
    except Exception as e:  # noqa: BLE001 - the eager side built, so this is the jit's failure
        raise _Stop(_classify(None, e, "jit()")) from e


def _both(action, eager: Side, jitted: Side, where: str,
          eager_guard: Callable[[], ContextManager] | None = None):
    """``action`` on each side (on the eager one inside ``eager_guard()``, if given); exceptions
    decide whether the program goes on."""
    results = []
    for side in (eager, jitted):
        try:
            with ambient():
                if side is eager and eager_guard is not None:
                    with eager_guard():
                        results.append((action(side), None))
                else:
                    results.append((action(side), None))
        except Mismatch:
            raise
        except Exception as e:  # noqa: BLE001 - every exception is compared with eager's
            results.append((None, e))
    (e_value, e_exc), (j_value, j_exc) = results
    if e_exc is None and j_exc is None:
        return e_value, j_value
    if eager_guard is not None and isinstance(e_exc, Warning) and (
            j_exc is None or not isinstance(j_exc, Warning)):
        # Eager warned, and the guard made the warning an error; the jitted side ran unguarded.
        raise _Stop(None, f"{where}: eager warned ({type(e_exc).__name__}: {_first_line(e_exc)})")
    outcome = _classify(e_exc, j_exc, where)
    raise _Stop(outcome, "" if outcome else f"{where}: {type(e_exc).__name__}: {_first_line(e_exc)}")


def _classify(e_exc, j_exc, where: str) -> Outcome | None:
    if j_exc is not None and isinstance(j_exc, keraunos.KeraunosError) and not isinstance(
            e_exc, type(j_exc)):
        return Outcome("refusal", _cause(j_exc), _first_line(j_exc))
    if e_exc is None:
        return Outcome("internal error", f"{where}: {type(j_exc).__name__}: {_cause(j_exc)}",
                       "".join(traceback.format_exception(j_exc)[-6:]))
    if j_exc is None:
        return Outcome("internal error", f"{where}: eager raised {type(e_exc).__name__}, jit did not",
                       f"eager: {type(e_exc).__name__}: {_first_line(e_exc)}")
    if type(e_exc) is not type(j_exc):
        return Outcome("internal error",
                       f"{where}: jit raised {type(j_exc).__name__} where eager raised {type(e_exc).__name__}",
                       f"eager: {_first_line(e_exc)}\njit: {_first_line(j_exc)}\n"
                       + "".join(traceback.format_exception(j_exc)[-6:]))
    return None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def _cause(exc: BaseException) -> str:
    """An exception's message with the program-specific parts (names, numbers, places) removed,
    so that refusals and errors of one cause count together."""
    text = _first_line(exc).replace("keraunos: ", "")
    text = re.sub(r"\S+\.py(:\d+)?|line \d+", "<place>", text)
    text = re.sub(r"'[^']*'|\"[^\"]*\"|`[^`]*`", "<x>", text)
    return re.sub(r"\d+", "N", text)[:100]


# ------------------------------------------------------------------------------- one call


def _call(step: Call, eager: Side, jitted: Side,
          eager_guard: Callable[[], ContextManager] | None = None) -> None:
    (e_out, e_named), (j_out, j_named) = _both(lambda side: call_one(step, side), eager, jitted,
                                               "call", eager_guard)
    compare_tree(e_out, j_out, "out", "output")
    e_flat, j_flat = flatten(e_out), flatten(j_out)
    compare_roles(e_flat, j_flat, e_named + _static(eager), j_named + _static(jitted))
    _compare_after(e_named, j_named, eager, jitted, "after the call")
    _backward(e_flat, j_flat, eager, jitted, eager_guard)
    _compare_after(e_named, j_named, eager, jitted, "after backward")


def _static(side: Side) -> list[tuple[str, torch.Tensor]]:
    """Tensors the program can reach besides its arguments: parameters, buffers, globals."""
    found = [(f"global {k}", v) for k, v in side.ns.items() if isinstance(v, torch.Tensor)]
    if side.model is not None:
        found += [(f"parameter {k}", v) for k, v in side.model.named_parameters()]
        found += [(f"buffer {k}", v) for k, v in side.model.named_buffers()]
    return found


def _compare_after(e_named, j_named, eager: Side, jitted: Side, when: str) -> None:
    for (name, e), (_, j) in zip(e_named, j_named):
        compare_tree(e, j, name, f"input {when}")
        if e.is_leaf:
            compare_tree(e.grad, j.grad, f"{name}.grad", f"gradient {when}")
    compare_states(module_state(eager.model), module_state(jitted.model), f"module {when}")
    compare_states(globals_of(eager), globals_of(jitted), f"global {when}")


def _backward(e_flat, j_flat, eager: Side, jitted: Side,
              eager_guard: Callable[[], ContextManager] | None = None) -> None:
    if not grad_outputs(e_flat) and not grad_outputs(j_flat):
        return
    _both(lambda side: backward_one(e_flat if side is eager else j_flat), eager, jitted, "backward",
          eager_guard)
