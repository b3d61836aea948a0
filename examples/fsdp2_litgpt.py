"""Train a small litgpt GPT with FSDP2 and keraunos, on CPU processes joined by gloo.

Run:   torchrun --nproc-per-node 2 examples/fsdp2_litgpt.py [--steps 5] [--order jit-then-shard]

Each block is `keraunos.jit`ted and then `fully_shard`ed (torchtitan's order, the default), or
the model is sharded and then jitted (`--order shard-then-jit`). FSDP2's hooks (all-gather,
reshard, gradient reduce-scatter) run eagerly around each block's compiled forward. Every step
is checked against eager FSDP2 on the same batches, and rank 0 prints the losses, keraunos's
cache counters and the first block's forward trace.
"""
from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import keraunos


def make_model():
    import litgpt
    from litgpt.model import GPT
    config = litgpt.Config.from_name("Llama-2-7b-hf", n_layer=2, n_embd=128, n_head=2,
                                     n_query_groups=2, intermediate_size=344,
                                     padded_vocab_size=512, vocab_size=512, block_size=64)
    torch.manual_seed(0)
    return GPT(config)


def shard(model, jit_blocks: bool):
    for i, block in enumerate(model.transformer.h):
        if jit_blocks:
            block = keraunos.jit(block)
            model.transformer.h[i] = block
        fully_shard(block)
    fully_shard(model)
    return model


def train(model, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for idx, targets in batches:
        opt.zero_grad(set_to_none=True)
        logits = model(idx)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--order", choices=["jit-then-shard", "shard-then-jit"],
                        default="jit-then-shard")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches
    batches = [(torch.randint(0, 512, (2, 32), generator=g),
                torch.randint(0, 512, (2, 32), generator=g)) for _ in range(args.steps)]

    base = make_model()
    eager = shard(copy.deepcopy(base), jit_blocks=False)
    if args.order == "jit-then-shard":
        compiled = shard(copy.deepcopy(base), jit_blocks=True)
        blocks = list(compiled.transformer.h)
    else:
        compiled = keraunos.jit(shard(copy.deepcopy(base), jit_blocks=False))
        blocks = [compiled]
    expected, got = train(eager, batches), train(compiled, batches)
    same = all(abs(a - b) <= 1e-4 * max(1.0, abs(a)) for a, b in zip(got, expected))
    if rank == 0:
        print(f"order: {args.order}, world size {dist.get_world_size()}")
        print("eager FSDP2 losses:   ", [f"{x:.4f}" for x in expected])
        print("keraunos FSDP2 losses:", [f"{x:.4f}" for x in got], "(as eager)" if same else
              "(DIFFER)")
        for i, block in enumerate(blocks):
            print(f"jitted module {i}: {keraunos.cache_misses(block)} compilation(s), "
                  f"{keraunos.cache_hits(block)} cache hits")
        print("\nthe first block's forward trace:")
        print(keraunos.last_traces(blocks[0])[-1])
    dist.destroy_process_group()
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
