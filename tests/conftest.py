"""Shared fixtures for keraunos' behaviour tests.

Every test compares a jitted program against eager PyTorch. The autouse fixture below seeds the
generator and restores the global state tests may change (grad mode, default dtype), so that
tests stay independent of their order.
"""
import os

# Every call's result is searched for capture's FakeTensors (keraunos/capture/leaks.py): set
# before keraunos is imported, which reads it once.
os.environ.setdefault("KERAUNOS_CHECK_RESULTS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _isolate_global_state():
    torch.manual_seed(0)
    grad = torch.is_grad_enabled()
    dtype = torch.get_default_dtype()
    yield
    torch.set_grad_enabled(grad)
    torch.set_default_dtype(dtype)


def pytest_configure(config):
    import os
    # Under pytest-xdist (README: -n auto) each worker is one process per core: one intra-op
    # thread each, or two workers' matmuls fight over the same cores.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
    # Every trace a pass makes and every trace compiled to Python is checked by the trace checker
    # (keraunos.core.lint): a malformed trace fails the test that made it.
    os.environ.setdefault("KERAUNOS_LINT", "1")
