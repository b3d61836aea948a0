"""keraunos on PyTorch's own OpInfo database: every op with float32 CPU samples, forward,
backward and in-place, compared with eager (see keraunos/testing/opinfo.py).

CI runs every op on its first ``KERAUNOS_OPINFO_SAMPLES`` samples (default 3), which keeps the
sweep to about a minute; ``python benchmarks/coverage.py`` runs every sample and writes
docs/coverage.md. Ops that cannot be supported are listed in ``UNSUPPORTED`` with the reason:
they are strict xfails, so one that starts working fails the run until it is taken off the list.
"""
import os

import pytest

from keraunos.testing.opinfo import KINDS, check_op, op_database, op_name

MAX_SAMPLES = int(os.environ.get("KERAUNOS_OPINFO_SAMPLES", "3")) or None

DATA_TO_PYTHON = "turns tensor data into a Python value (.item(), bool of a tensor): control " \
                 "flow on data cannot be captured"
UNSUPPORTED = {
    ("item", "forward"): DATA_TO_PYTHON,
    ("allclose", "forward"): DATA_TO_PYTHON,
    ("equal", "forward"): DATA_TO_PYTHON,
    ("corrcoef", "forward"): "checks its input with a data-dependent Python branch",
    ("corrcoef", "backward"): "checks its input with a data-dependent Python branch",
    ("cov", "forward"): "checks its weights with a data-dependent Python branch",
    ("cov", "backward"): "checks its weights with a data-dependent Python branch",
    ("nn.functional.ctc_loss", "forward"): "reads target lengths as Python numbers",
    ("nn.functional.ctc_loss", "backward"): "reads target lengths as Python numbers",
    ("nn.functional.gaussian_nll_loss", "forward"): "raises on negative variance after a "
                                                     "data-dependent check",
    ("nn.functional.gaussian_nll_loss", "backward"): "raises on negative variance after a "
                                                      "data-dependent check",
    ("linalg.lstsq", "forward"): "checks the driver's result with a data-dependent branch",
    ("linalg.lstsq", "backward"): "checks the driver's result with a data-dependent branch",
    ("linalg.lstsq.grad_oriented", "forward"): "checks the driver's result with a "
                                               "data-dependent branch",
    ("linalg.lstsq.grad_oriented", "backward"): "checks the driver's result with a "
                                                "data-dependent branch",
    ("tensor_split", "forward"): "split points given as a tensor are read as Python numbers",
    ("tensor_split", "backward"): "split points given as a tensor are read as Python numbers",
    ("sparse.sampled_addmm", "forward"): "sparse tensors are not captured",
    ("sparse.sampled_addmm", "backward"): "sparse tensors are not captured",
    ("sparse.mm.reduce", "forward"): "sparse tensors are not captured",
    ("sparse.mm.reduce", "backward"): "sparse tensors are not captured",
    ("to_sparse", "forward"): "sparse tensors are not captured",
    ("to_sparse", "backward"): "sparse tensors are not captured",
    ("addbmm", "inplace"): "PyTorch's fake kernel of addbmm_ rejects a broadcast input that the "
                           "CPU kernel accepts (output shape [1] vs [5, 10])",
}


def _cases():
    cases = []
    for op in op_database():
        for kind in KINDS:
            key = (op_name(op), kind)
            marks = []
            if key in UNSUPPORTED:
                marks.append(pytest.mark.xfail(reason=UNSUPPORTED[key], strict=True))
            cases.append(pytest.param(op, kind, id=f"{key[0]}-{kind}", marks=marks))
    return cases


@pytest.mark.parametrize("op, kind", _cases())
def test_op_matches_eager(op, kind):
    result = check_op(op, kind, MAX_SAMPLES)
    if result.status == "not applicable":
        pytest.skip(f"not applicable: {result.message}")
    assert result.status == "passed", result.message
