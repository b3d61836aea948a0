"""Run scenarios on several local processes joined by gloo over 127.0.0.1, with timeouts.

``run_scenarios(module, names, world_size)`` spawns ``world_size`` processes; each joins one
process group (gloo, loopback only, a timeout on every collective), runs every scenario, a
function ``scenario(rank, world_size)`` of ``module``, in order, and sends back per scenario
what it returned or the error it raised. The parent waits at most ``timeout`` seconds in all,
then kills what is left: a rank that fails or hangs can never hang the test run.
"""
from __future__ import annotations

import datetime
import importlib
import multiprocessing
import os
import queue
import socket
import traceback

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=30)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, module: str, names: list, results,
               backend: str = "gloo") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        if backend == "nccl":  # one GPU a rank (tests/test_distributed_cuda.py)
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=COLLECTIVE_TIMEOUT)
    except Exception:  # noqa: BLE001 - reported to the parent as every scenario's failure
        results.put((rank, None, ("error", traceback.format_exc())))
        return
    scenarios = importlib.import_module(module)
    for name in names:
        torch.manual_seed(0)
        try:
            outcome = ("ok", getattr(scenarios, name)(rank, world_size))
        except BaseException as e:  # noqa: BLE001 - the test decides what an error means
            outcome = ("raised", (type(e).__name__, str(e), traceback.format_exc()))
        results.put((rank, name, outcome))
        dist.barrier()  # ranks stay in step: a scenario's collectives never meet the next's
    dist.destroy_process_group()


def run_scenarios(module: str, names: list[str], world_size: int = 2,
                  timeout: float = 150.0, backend: str = "gloo") -> dict[str, list]:
    """``{scenario: [outcome of rank 0, outcome of rank 1, ...]}``; an outcome is ``("ok",
    value)``, ``("raised", (type name, message, traceback))``, or ``("missing", why)`` for a
    rank that died or ran out of time before reporting it."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_rank_main, daemon=True,
                                 args=(rank, world_size, port, module, names, results,
                                       backend))
                 for rank in range(world_size)]
    for p in processes:
        p.start()
    outcomes: dict[str, list] = {name: [None] * world_size for name in names}
    expected = len(names) * world_size
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    received = 0
    setup_error = None
    while received < expected:
        left = (deadline - datetime.datetime.now()).total_seconds()
        if left <= 0:
            break
        try:
            rank, name, outcome = results.get(timeout=min(left, 5.0))
        except queue.Empty:
            if not any(p.is_alive() for p in processes):
                break
            continue
        if name is None:
            setup_error = outcome[1]
            break
        outcomes[name][rank] = outcome
        received += 1
    for p in processes:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    why = setup_error or f"no report within {timeout:.0f} s (a rank died or hung)"
    for name in names:
        outcomes[name] = [o if o is not None else ("missing", why) for o in outcomes[name]]
    return outcomes
