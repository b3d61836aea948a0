"""DDP's backward split at bucket boundaries on GPUs with NCCL (two ranks, a GPU each): the
scenario of tests/test_distributed.py, where the overlap of all-reduces with the backward is what
the split is for. Skipped without two CUDA devices and NCCL; scripts/gpu_check.sh runs it."""
import pytest
import torch

from distributed_ranks import run_scenarios
from test_distributed import values

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2
         and torch.distributed.is_available() and torch.distributed.is_nccl_available()),
    reason="needs two CUDA devices and NCCL")


def test_ddp_backward_split_on_nccl_overlaps_and_trains_like_eager():
    name = "ddp_backward_is_split_at_bucket_boundaries"
    outcomes = run_scenarios("distributed_scenarios", [name], world_size=2, backend="nccl")
    for rank in values(outcomes, name):
        for order, r in rank.items():
            assert r["losses"] and r["grads"] and r["params"], (order, r)
            assert r["nodes"] >= 3 and r["misses"] == 1, (order, r)
            assert all(n >= 2 for n in r["early"][1:]), (order, r)
