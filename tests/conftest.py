"""Shared fixtures for keraunos' behaviour tests.

Every test compares a jitted program against eager PyTorch. The autouse fixture below seeds the
generator and restores the global state tests may change (grad mode, default dtype), so that
tests stay independent of their order.
"""
import os

# Every call's result is searched for capture's FakeTensors (keraunos/capture/leaks.py): set
# before keraunos is imported, which reads it once.
os.environ.setdefault("KERAUNOS_CHECK_RESULTS", "1")
# Fusion off unless a test asks for it: the default (fuse="background") would compile a fused
# tier of every test's program on a background thread, competing for the two cores with the
# tests themselves and switching programs mid-test. Tests of fusion pass fuse="wait" (the
# fused program from the first call), tests of the tiers pass fuse="background"
# (tests/test_tiers.py); tests of the default itself clear this (monkeypatch.delenv).
os.environ.setdefault("KERAUNOS_FUSE", "off")
# No helper processes compiling regions ahead (executors/fusion/workers.py): whether they would
# start depends on the machine's load, and a region a helper compiled is a cache hit here, which
# tests of the caches would see. tests/test_compile_workers.py starts its own.
os.environ.setdefault("KERAUNOS_COMPILE_WORKERS", "0")
# keraunos's store (keraunos/persist/store.py) in a directory of this run, not the user's ~/.cache: what
# an earlier run stored (today: which vector-ISA test libraries load) never decides a test.
if "KERAUNOS_CACHE_DIR" not in os.environ:
    import tempfile  # noqa: E402
    os.environ["KERAUNOS_CACHE_DIR"] = tempfile.mkdtemp(prefix="keraunos-test-store-")

# No captured programs kept between tests (keraunos/persist/programs.py): a test that jits a module
# another test jitted would load its program instead of capturing, and tests of capture would see
# that. tests/test_program_store.py turns it on in the processes it starts.
os.environ.setdefault("KERAUNOS_PROGRAM_STORE", "0")

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
    # Tests marked ``long`` start first (``pytest_collection_modifyitems``, below).
    config.addinivalue_line(
        "markers", "long: a test of tens of seconds on two cores; the run starts it first")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``long`` first, each group in collection order. Under pytest-xdist's
    worksteal (README: -n auto --dist worksteal) the run ends when its last test does: a long
    test collected late runs alone at the end while the other workers wait. A module whose
    module-scoped fixture serves all its tests is marked whole, so the fixture is made once."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
