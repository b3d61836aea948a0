"""keraunos with torch.distributed, on 2 local gloo ranks: collectives captured or refused,
never dropped; DDP around a jitted model trains as one process would; FSDP2 and tensor parallel
(DTensor, tests/dtensor_scenarios.py) train as eager does.

All scenarios (tests/distributed_scenarios.py) run in one spawn of two processes per module
(tests/distributed_ranks.py: loopback only, 30 s per collective, 150 s in all); each test reads
its scenario's outcome on every rank.
"""
import pytest
import torch

from distributed_ranks import run_scenarios

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="this torch build has no torch.distributed")

SCENARIOS = [
    "all_reduce_matches_eager",
    "all_reduce_of_an_input_writes_it_back",
    "gather_scatter_and_broadcast_match_eager",
    "functional_collective_gradients_match_eager",
    "in_place_collective_of_a_tensor_requiring_grad_is_refused",
    "async_collective_is_refused",
    "barrier_and_point_to_point_are_refused",
    "jitted_model_inside_ddp_trains_like_one_process",
    "both_ddp_orders_train_alike",
    "ddp_backward_is_split_at_bucket_boundaries",
    "the_torch_compile_backend_matches_eager",
    "dtensor_function_matches_eager",
    "tensor_parallel_inference_matches_eager",
    "tensor_parallel_mlp_trains_like_eager",
    "tensor_parallel_attention_trains_like_eager",
    "dtensor_outputs_with_gradients_match_eager",
    "sharded_batch_with_replicated_weight_matches_eager",
    "tensor_parallel_under_the_torch_compile_backend",
    "dtensor_programs_capture_cannot_replay_are_refused",
    "dtensor_outputs_reaching_different_inputs_are_refused",
    "dtensor_op_sweep_matches_eager_or_is_refused",
    "fsdp2_jitted_blocks_and_jitted_model_train_like_eager",
    "fsdp2_mixed_precision_trains_like_eager",
    "fsdp2_activation_checkpointing_trains_like_eager",
    "fsdp2_units_that_differ_compile_programs_of_their_own",
    "fsdp2_units_sharded_inside_a_jitted_model_are_refused",
]


@pytest.fixture(scope="module")
def outcomes():
    return run_scenarios("distributed_scenarios", SCENARIOS, world_size=2)


def values(outcomes, name):
    """What the scenario returned on each rank (a rank's error fails the test, with its trace)."""
    per_rank = outcomes[name]
    for rank, (status, value) in enumerate(per_rank):
        if status != "ok":
            detail = value[2] if status == "raised" else value
            pytest.fail(f"rank {rank} of {name}: {status}\n{detail}")
    return [value for _, value in per_rank]


def test_in_place_all_reduce_is_a_functional_collective_and_matches_eager(outcomes):
    for rank in values(outcomes, "all_reduce_matches_eager"):
        assert rank == {"same": [True, True, True], "hits": 2, "functional in trace": True}


def test_all_reduce_of_an_input_writes_the_input_back_for_each_reduce_op(outcomes):
    assert values(outcomes, "all_reduce_of_an_input_writes_it_back") == [[True] * 3] * 2


def test_gather_scatter_all_to_all_and_broadcast_match_eager(outcomes):
    assert values(outcomes, "gather_scatter_and_broadcast_match_eager") == [[True, True]] * 2


def test_functional_collective_gradients_match_eager(outcomes):
    assert values(outcomes, "functional_collective_gradients_match_eager") == [True, True]


def test_in_place_collective_of_a_tensor_requiring_grad_is_refused(outcomes):
    # Eager warns that no autograd kernel is registered and lets the gradient through.
    for kind, message in values(outcomes, "in_place_collective_of_a_tensor_requiring_grad_is_refused"):
        assert kind == "CaptureError" and "no gradient" in message


def test_async_collective_is_refused_not_dropped(outcomes):
    for kind, message in values(outcomes, "async_collective_is_refused"):
        assert kind == "CaptureError" and "async_op=True" in message


def test_barrier_and_point_to_point_are_refused_not_dropped(outcomes):
    for barrier, send in values(outcomes, "barrier_and_point_to_point_are_refused"):
        assert barrier[0] == "CaptureError" and "barrier" in barrier[1]
        assert send[0] == "CaptureError" and ("send" in send[1] or "recv" in send[1])


def test_ddp_of_a_jitted_model_trains_like_one_process_on_all_batches(outcomes):
    for rank in values(outcomes, "jitted_model_inside_ddp_trains_like_one_process"):
        assert rank["losses"] == [True] * 3 and rank["params"]
        assert rank["hits"] == 2


def test_jit_of_ddp_trains_as_ddp_of_jit_and_eager_ddp_with_buffers_and_no_sync(outcomes):
    for rank in values(outcomes, "both_ddp_orders_train_alike"):
        assert len(rank) == 4
        for case, (same, agree, misses, hits) in rank.items():
            assert same and agree, case
            # One compilation, then hits (no_sync's step runs the same program).
            assert misses == 1 and hits >= 2, case


def test_ddp_backward_is_split_at_bucket_boundaries_so_all_reduces_overlap_it(outcomes):
    # As torch.compile's DDPOptimizer does: one autograd node per stretch of the backward that
    # completes a bucket of DDP's reducer, whose all-reduce then starts while the later nodes
    # run; the trace marks each boundary. Results equal eager DDP's with the same buckets.
    for rank in values(outcomes, "ddp_backward_is_split_at_bucket_boundaries"):
        assert set(rank) == {"DDP(jit(m))", "jit(DDP(m))", "DDP(jit(m, fuse='wait'))"}
        assert rank["DDP(jit(m, fuse='wait'))"]["fused"]
        for order, r in rank.items():
            assert r["losses"] and r["grads"] and r["params"], (order, r)
            buckets, eager_buckets = r["buckets"]
            assert buckets == eager_buckets >= 3, (order, r)
            assert r["nodes"] >= 3 and r["misses"] == 1, (order, r)
            # Step 0: DDP's single first bucket waits for the whole backward; from step 2 on
            # (step 1 is no_sync), buckets are all-reduced before the last node runs.
            assert r["early"][0] == 0 and all(n >= 2 for n in r["early"][1:]), (order, r)


def test_collectives_and_ddp_under_the_torch_compile_backend_match_eager(outcomes):
    for rank in values(outcomes, "the_torch_compile_backend_matches_eager"):
        assert rank == {"all_reduce": [True, True, True],
                        "ddp": {"_model": True, "_WithBuffer": True}, "fsdp2": True}


def test_dtensor_function_is_flattened_to_local_ops_and_matches_eager(outcomes):
    # DTensor results (sharded, redistributed, partial) are rebuilt by the epilogue around the
    # local results: no capture-time tensor leaks; an input of other placements recompiles.
    for rank in values(outcomes, "dtensor_function_matches_eager"):
        assert rank["same"] == [True, True] and rank["leak"] is None
        assert rank["gather in trace"] and rank["spec checked"]
        assert rank["resharded"] and (rank["misses"], rank["hits"]) == (2, 1)
        assert rank["same DTensor twice"] == [True, True]
        assert rank["placements found by name"] == [True, True, True, 2]


def test_tensor_parallel_inference_matches_eager_and_shows_the_all_reduce(outcomes):
    for rank in values(outcomes, "tensor_parallel_inference_matches_eager"):
        assert rank == {"same": [True] * 3, "hits": 2, "all_reduce in trace": True}


def test_tensor_parallel_mlp_trains_like_eager_with_dtensor_gradients(outcomes):
    # Losses, gradients (local values and placements) and parameters after each SGD step equal
    # eager tensor parallel's on every rank; one compilation, then hits.
    for rank in values(outcomes, "tensor_parallel_mlp_trains_like_eager"):
        for case, r in rank.items():
            assert r["losses"] == r["grads"] == r["params"] == [True] * 3, (case, r)
            assert (r["misses"], r["hits"]) == (1, 2), (case, r)
            assert r["forward all_reduce"], case
        assert rank["parameters and input"]["input grads"] == [True] * 3
        # The input's gradient is partial on each rank: from_local's backward all-reduces it.
        assert rank["parameters and input"]["backward all_reduce"]


def test_tensor_parallel_attention_block_trains_like_eager(outcomes):
    # A LayerNorm's plain parameters beside DTensor ones, head views of the local outputs, SDPA.
    for rank in values(outcomes, "tensor_parallel_attention_trains_like_eager"):
        assert rank == {"losses": [True] * 2, "grads": [True] * 2, "params": [True] * 2,
                        "hits": 1}


def test_dtensor_outputs_carry_dtensor_gradients_back(outcomes):
    for rank in values(outcomes, "dtensor_outputs_with_gradients_match_eager"):
        assert rank == {"same": [True, True], "grads": [True, True], "hits": 1}


def test_replicated_weight_of_a_sharded_batch_gets_eagers_partial_gradient(outcomes):
    for rank in values(outcomes, "sharded_batch_with_replicated_weight_matches_eager"):
        assert rank == {"same": [True, True], "grads": [True, True],
                        "placements": "(Partial(sum),)"}


def test_torch_compile_backend_compiles_tensor_parallel_graphs_and_matches_eager(outcomes):
    for rank in values(outcomes, "tensor_parallel_under_the_torch_compile_backend"):
        assert rank["losses"] == rank["grads"] == rank["params"] == [True] * 2, rank
        assert rank["no_grad"] and rank["ran eagerly"] == [] and rank["all_reduce in trace"]


def test_dtensor_programs_capture_cannot_replay_are_refused(outcomes):
    for rank in values(outcomes, "dtensor_programs_capture_cannot_replay_are_refused"):
        kind, message = rank["in place"]
        assert kind == "CaptureError" and "writes a tensor in place" in message
        kind, message = rank["grad read"]
        assert kind == "CaptureError" and "`.grad` of a DTensor" in message
        kind, message = rank["resharded gradient"]
        assert kind == "CaptureError" and "(Shard(dim=0),), where its input has" in message


def test_dtensor_outputs_reaching_different_inputs_are_refused(outcomes):
    for kind, message in values(outcomes, "dtensor_outputs_reaching_different_inputs_are_refused"):
        assert kind == "CaptureError" and "reach different inputs" in message


def test_dtensor_ops_over_placement_pairs_match_eager_or_are_refused(outcomes):
    # 12 ops x 9 placement pairs x with and without gradients: equal to eager, or refused (with
    # gradients, when an input's gradient is sharded otherwise than the input); never different.
    for rank in values(outcomes, "dtensor_op_sweep_matches_eager_or_is_refused"):
        assert rank["different"] == [], rank
        # 143 same and 73 refused with torch 2.13; other releases may shard some otherwise.
        counts = rank["counts"]
        assert sum(counts.values()) == 216 and counts["same"] > counts["refused"], rank


def _check_fsdp2(outcomes, name, hits=4):
    for rank in values(outcomes, name):
        assert set(rank) == {"blocks jitted", "model jitted"}
        for order, r in rank.items():
            assert r["losses"] and r["grads"] and r["params"], (order, r)
            assert r["reference"], (order, r)
            assert r["leak"] is None, (order, r)
            # One miss per block (two blocks), then hits on the other two steps (and, with
            # checkpointing, on each backward's recomputation).
            assert (r["misses"], r["hits"]) == (2, hits), (order, r)
        # The identical blocks share one compiled program (the second block's miss rebinds
        # the first one's entry), in both orders.
        assert rank["model jitted"]["programs"] == rank["blocks jitted"]["programs"] == 1, rank


def test_fsdp2_jitted_blocks_and_jitted_sharded_model_train_like_eager_fsdp2(outcomes):
    # fully_shard(keraunos.jit(block)) and keraunos.jit(fully_shard(model)): FSDP2's hooks run
    # eagerly around each block's compiled forward; every rank's losses, gradients and
    # parameters equal eager FSDP2's and a single process's over all ranks' batches.
    _check_fsdp2(outcomes, "fsdp2_jitted_blocks_and_jitted_model_train_like_eager")


def test_fsdp2_mixed_precision_trains_like_eager_fsdp2(outcomes):
    _check_fsdp2(outcomes, "fsdp2_mixed_precision_trains_like_eager")


def test_fsdp2_activation_checkpointing_trains_like_eager_fsdp2(outcomes):
    # torch.utils.checkpoint around each FSDP unit: the recomputation in the backward runs the
    # compiled forward again, with FSDP2 re-gathering the parameters; checkpoint's early stop
    # interrupts that call once it holds the tensors it needs, so it counts as no hit (the hit
    # path counts a call when it returns): 4 hits, the two later steps' forwards of each block.
    _check_fsdp2(outcomes, "fsdp2_activation_checkpointing_trains_like_eager", hits=4)


def test_fsdp2_units_that_differ_compile_programs_of_their_own(outcomes):
    for rank in values(outcomes, "fsdp2_units_that_differ_compile_programs_of_their_own"):
        # (same as eager, programs compiled) per case and order
        assert rank == {
            "other eps, model jitted": (True, 2), "other eps, blocks jitted": (True, 2),
            "hooked linear, model jitted": (True, 2), "hooked linear, blocks jitted": (True, 2),
            "hooked block, model jitted": (True, 1), "hooked block, blocks jitted": (True, 2),
            "equal eps, model jitted": (True, 1), "equal eps, blocks jitted": (True, 1)}, rank


def test_fsdp2_units_sharded_after_jitting_their_model_are_refused_with_what_to_do(outcomes):
    for kind, message in values(outcomes, "fsdp2_units_sharded_inside_a_jitted_model_are_refused"):
        assert kind == "UnsupportedInputError" and "fully_shard'ed after" in message
        assert "keraunos.jit(block)" in message
