"""What a restart saves when the program store (keraunos/persist/programs.py) holds a jitted
function's program and a symbolic entry's.

Run: python benchmarks/program_store.py [--repeats 3] [--cases function,generate,train,transformers]

Each case runs in fresh processes, on one cache directory per repeat: ``cold`` (an empty store:
capture, then kept), ``restart`` (the store holds what ``cold`` kept: loaded) and ``restart,
no store`` (``KERAUNOS_PROGRAM_STORE=0`` on the same directory: captured as before), the two
restarts taking turns. One intra-op thread, the torch executor (``KERAUNOS_FUSE=off``: no kernel
compiles, so the figures are capture and the passes against a load). Medians over the repeats.

- ``function``: ``keraunos.jit`` of a Python function, an 8-layer transformer written with
  ``torch.nn.functional`` over a list of weight tensors, one forward and backward: the time of
  the first call (compile and run) and of the same call once compiled.
- ``generate``: litgpt's ``generate`` on a 2-layer KV-cache GPT (``keraunos.jit(model)``), prompts
  of 7, 11 and 16 tokens, 8 new tokens each: the second prompt length makes the prefill's
  sequence dimension symbolic (automatic dynamic), and the third is served by that symbolic
  entry. The time of each prompt's first generate, and where its program came from.
- ``train``: ``keraunos.jit`` of a whole training step (zero_grad, a 2-layer litgpt GPT's forward
  and loss, backward, clipping, AdamW, a cosine schedule): the time of its first three calls (the
  optimizer's state made, the step captured, captured again with its rate a symbol) and of one
  call once compiled; losses compared with an eager copy.
- ``transformers``: a Hugging Face Llama (the model zoo's tiny config, random weights), one
  forward under ``no_grad``: the first call and the same call once compiled.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------ in the child
def transformer(x, layers):
    import torch.nn.functional as F
    for ln, qkv, proj, up, down in layers:
        h = F.layer_norm(x, (x.shape[-1],), ln)
        q, k, v = (h @ qkv).chunk(3, dim=-1)
        b, t, c = q.shape
        # (no generator expression: its closure cells would make the program not kept)
        q = q.view(b, t, 4, c // 4).transpose(1, 2)
        k = k.view(b, t, 4, c // 4).transpose(1, 2)
        v = v.view(b, t, 4, c // 4).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + a.transpose(1, 2).reshape(b, t, c) @ proj
        x = x + F.gelu(F.layer_norm(x, (c,)) @ up) @ down
    return x


def child_function() -> dict:
    import torch
    import keraunos
    torch.manual_seed(0)
    width = 64
    layers = [[torch.randn(width).requires_grad_(), torch.randn(width, 3 * width) * 0.05,
               torch.randn(width, width) * 0.05, torch.randn(width, 4 * width) * 0.05,
               torch.randn(4 * width, width) * 0.05] for _ in range(8)]
    for layer in layers:
        for w in layer[1:]:
            w.requires_grad_()
    x = torch.randn(2, 16, width)
    expected = transformer(x, layers)
    jitted = keraunos.jit(transformer)
    t0 = time.perf_counter()
    out = jitted(x, layers)
    out.sum().backward()
    first = time.perf_counter() - t0
    torch.testing.assert_close(out, expected)
    t0 = time.perf_counter()
    jitted(x, layers).sum().backward()
    again = time.perf_counter() - t0
    keraunos.persist.programs.wait_for_keeps()
    return {"first call": first, "compiled call": again,
            "store": [keraunos.compile_stats(jitted).program_store]}


def child_generate() -> dict:
    import torch
    import keraunos
    import litgpt
    from litgpt.generate.base import generate
    from litgpt.model import GPT
    from keraunos.runtime.call import state_of
    torch.manual_seed(0)
    config = litgpt.Config(n_layer=2, n_head=4, n_embd=64, vocab_size=128,
                           padded_vocab_size=128, block_size=256)
    model = GPT(config).eval()
    eager = copy.deepcopy(model)
    jitted = keraunos.jit(model)
    out, same = {}, True
    for length in (7, 11, 16):
        prompt = torch.randint(0, 128, (length,), generator=torch.Generator().manual_seed(length))
        model.max_seq_length = 256
        model.set_kv_cache(batch_size=1)
        t0 = time.perf_counter()
        tokens = generate(jitted, prompt, length + 8, temperature=0.0, top_k=1)
        out[f"prompt {length}"] = time.perf_counter() - t0
        eager.max_seq_length = 256
        eager.set_kv_cache(batch_size=1)
        same = same and torch.equal(tokens, generate(eager, prompt, length + 8, temperature=0.0,
                                                     top_k=1))
        keraunos.persist.programs.wait_for_keeps()
    if not same:
        raise AssertionError("the jitted model generated other tokens than eager")
    out["misses"] = keraunos.cache_misses(jitted)
    # each entry, oldest first: what the store did with it
    out["store"] = [e.program_store for e in reversed(state_of(jitted).entries)]
    return out


def child_transformers() -> dict:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    import keraunos
    from keraunos.testing.zoo import inputs_of, make_models
    model, eager = make_models("llama")
    inputs = inputs_of("llama", seed=0, mask=False, labels=False)
    jitted = keraunos.jit(model)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = jitted(**inputs)
        first = time.perf_counter() - t0
        torch.testing.assert_close(out.logits, eager(**inputs).logits)
        t0 = time.perf_counter()
        jitted(**inputs)
        again = time.perf_counter() - t0
    keraunos.persist.programs.wait_for_keeps()
    return {"first call": first, "compiled call": again,
            "store": [keraunos.compile_stats(jitted).program_store]}


def one_step(model, optimizer, scheduler, idx, targets):
    import torch
    import torch.nn.functional as F
    optimizer.zero_grad(set_to_none=True)
    logits = model(idx)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    return loss


def train_step():
    # (what it trains is found by name, as a training script's globals: the store keeps no
    # argument objects)
    return one_step(MODEL, OPTIMIZER, SCHEDULER, IDX, TARGETS)


def child_train() -> dict:
    global MODEL, OPTIMIZER, SCHEDULER, IDX, TARGETS
    import torch
    import keraunos
    import litgpt
    from litgpt.model import GPT
    torch.manual_seed(0)
    config = litgpt.Config(n_layer=2, n_head=4, n_embd=128, vocab_size=512,
                           padded_vocab_size=512, block_size=64)
    MODEL = GPT(config)
    eager = copy.deepcopy(MODEL)
    OPTIMIZER, eager_optimizer = (torch.optim.AdamW(m.parameters(), lr=1e-3)
                                  for m in (MODEL, eager))
    SCHEDULER, eager_scheduler = (torch.optim.lr_scheduler.CosineAnnealingLR(o, 100)
                                  for o in (OPTIMIZER, eager_optimizer))
    IDX, TARGETS = torch.randint(0, 512, (2, 32)), torch.randint(0, 512, (2, 32))
    jitted = keraunos.jit(train_step)
    t0 = time.perf_counter()
    losses = [jitted(), jitted(), jitted()]  # the optimizer's state, then the rate a symbol
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    losses.append(jitted())
    again = time.perf_counter() - t0
    expected = [one_step(eager, eager_optimizer, eager_scheduler, IDX, TARGETS) for _ in losses]
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected).detach())
    keraunos.persist.programs.wait_for_keeps()
    return {"first three calls": first, "compiled call": again,
            "store": [keraunos.compile_stats(jitted).program_store]}


MODEL = OPTIMIZER = SCHEDULER = IDX = TARGETS = None  # child_train's


CHILDREN = {"function": child_function, "generate": child_generate,
            "transformers": child_transformers, "train": child_train}


# ------------------------------------------------------------------------------ the driver
def run_child(case: str, directory: str, store: bool) -> dict:
    env = {**os.environ, "KERAUNOS_CACHE_DIR": directory, "KERAUNOS_FUSE": "off",
           "KERAUNOS_PROGRAM_STORE": "1" if store else "0", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__, "--child", case], env=env,
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default="function,generate")
    parser.add_argument("--child")
    a = parser.parse_args()
    if a.child:
        import torch
        torch.set_num_threads(1)
        print(json.dumps(CHILDREN[a.child]()))
        return
    for case in a.cases.split(","):
        runs: dict[str, list[dict]] = {"cold": [], "restart": [], "restart, no store": []}
        for repeat in range(a.repeats):
            with tempfile.TemporaryDirectory() as directory:
                runs["cold"].append(run_child(case, directory, True))
                order = [("restart", True), ("restart, no store", False)]
                for name, store in (order if repeat % 2 == 0 else order[::-1]):
                    runs[name].append(run_child(case, directory, store))
        print(f"\n{case} (medians of {a.repeats})")
        timed = [k for k, v in runs["cold"][0].items() if isinstance(v, float)]
        print(f"| | {' | '.join(timed)} | program store |")
        print("|---|" + "---|" * (len(timed) + 1))
        base = {k: statistics.median(r[k] for r in runs["restart, no store"]) for k in timed}
        for name, results in runs.items():
            cells = []
            for k in timed:
                m = statistics.median(r[k] for r in results)
                cells.append(f"{m * 1000:.0f} ms ({m / base[k]:.2f}x)")
            print(f"| {name} | {' | '.join(cells)} | {', '.join(results[-1]['store'])} |")


if __name__ == "__main__":
    main()
