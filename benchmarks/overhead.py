"""Per-call overhead: eager vs keraunos vs keraunos + ExtractionOnlyPrologueTransform vs torch.compile.

Run: python benchmarks/overhead.py [--calls N] [--skip-compile]

Two programs, all figures measured in this one run, medians over many calls, one intra-op thread:
- a tiny function, gelu(x @ y + 1).sum(-1) with x 4x8 and y 8x8: whole-call time; and its cache
  hit on a symbolic entry (dynamic=True) against a static one, prologue alone, computation alone
  and whole call, timed in turns;
- a Llama-3-8B-shaped litgpt GPT (all 32 layers and every parameter tensor of the real config,
  tiny widths), input (1, 8), under torch.no_grad(): the prologue alone (the cache-hit checks) and
  the whole call; plus a reference, a plain Python loop checking shape, dtype, device and
  requires_grad of the same tensors the prologue checks.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import keraunos
from keraunos.transforms import ExtractionOnlyPrologueTransform


def median_time(fn, calls: int, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def tiny(x, y):
    return F.gelu(x @ y + 1).sum(-1)


def reference_check_loop(tensors, expected):
    """What checking every tensor one by one in Python costs."""
    def loop():
        for t, (shape, dtype, device, requires_grad) in zip(tensors, expected):
            if (t.shape != shape or t.dtype != dtype or t.device != device
                    or t.requires_grad != requires_grad):
                return False
        return True
    return loop


def dynamo_guard_check(compiled_fn, code, frame_locals):
    """A callable running torch.compile's guards for the cached frame, or None if unavailable."""
    try:
        entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code)
        manager = entries[0].guard_manager
        if not manager.check(frame_locals):
            return None
        return lambda: manager.check(frame_locals)
    except Exception:
        return None


def row(name, seconds, eager):
    ratio = f"{seconds / eager:6.2f}x" if eager else "      "
    return f"  {name:<44} {seconds * 1e6:10.2f} us  {ratio}"


def bench_tiny(calls: int, with_compile: bool):
    x, y = torch.randn(4, 8), torch.randn(8, 8)
    systems = {"eager": tiny, "keraunos": keraunos.jit(tiny),
               "keraunos + ExtractionOnlyPrologueTransform":
                   keraunos.jit(tiny, transforms=[ExtractionOnlyPrologueTransform()])}
    if with_compile:
        systems["torch.compile"] = torch.compile(tiny)
    times = {}
    for name, fn in systems.items():
        torch.testing.assert_close(fn(x, y), tiny(x, y))
        times[name] = median_time(lambda: fn(x, y), calls)
    print("tiny function gelu(x @ y + 1).sum(-1), x 4x8, y 8x8: whole call (ratio to eager)")
    for name, t in times.items():
        print(row(name, t, times["eager"]))
    return times


def interleaved_times(fns: dict, calls: int, batch: int = 100) -> dict[str, float]:
    """Per-call thread CPU time of each callable: batches of ``batch`` calls, the callables
    taking turns, and for each the 10th percentile of its batches. Taking turns puts a change
    of the machine's load on all of them alike (timing one after the other compared one
    stretch of load with another: 1.59x here for what is 1.06x in instructions, by callgrind);
    a low percentile of thread time leaves out the batches other processes interrupted."""
    for fn in fns.values():
        for _ in range(20):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(max(calls // batch, 10)):
        for name, fn in fns.items():
            t0 = time.thread_time()
            for _ in range(batch):
                fn()
            samples[name].append((time.thread_time() - t0) / batch)
    return {name: sorted(v)[len(v) // 10] for name, v in samples.items()}


def bench_symbolic(calls: int):
    """The tiny function's cache hit on a static entry and on a symbolic one (dynamic=True: every
    size a symbol, its guards and bindings checked in the prologue): the prologue alone, the
    computation alone and the whole call, each with its ratio to the static entry's, all timed
    in turns (``interleaved_times``)."""
    x, y = torch.randn(4, 8), torch.randn(8, 8)
    systems = {"keraunos, static entry": keraunos.jit(tiny, dynamic=False),
               "keraunos, symbolic entry": keraunos.jit(tiny, dynamic=True)}
    fns = {}
    for name, fn in systems.items():
        torch.testing.assert_close(fn(x, y), tiny(x, y))
        entry = keraunos.state_of(fn).last_entry
        inputs = entry.prologue_fn(x, y)[0]
        fns[("prologue alone", name)] = lambda entry=entry: entry.prologue_fn(x, y)
        fns[("computation alone", name)] = lambda e=entry, i=inputs: e.computation_fn(*i)
        fns[("whole call", name)] = lambda fn=fn: fn(x, y)
    times = interleaved_times(fns, calls * 2)
    assert keraunos.cache_misses(systems["keraunos, symbolic entry"]) == 1
    static = "keraunos, static entry"
    print("\ntiny function, symbolic vs static cache entry (ratio to the static entry; "
          "thread time, timed in turns)")
    results = {}
    for label in ("prologue alone", "computation alone", "whole call"):
        print(f"  {label}")
        results[label] = {name: times[(label, name)] for name in systems}
        for name, t in results[label].items():
            print(row("  " + name, t, results[label][static]))
    return results


def llama3_shaped():
    import litgpt
    from litgpt.model import GPT
    config = litgpt.Config.from_name("Llama-3-8B", n_embd=128, intermediate_size=256,
                                     padded_vocab_size=256, vocab_size=256, block_size=64)
    torch.manual_seed(0)
    return GPT(config).eval()


def bench_llama(calls: int, with_compile: bool):
    model = llama3_shaped()
    idx = torch.randint(0, 256, (1, 8))
    full = keraunos.jit(model)
    extraction = keraunos.jit(model, transforms=[ExtractionOnlyPrologueTransform()])
    systems = {"eager": model, "keraunos": full,
               "keraunos + ExtractionOnlyPrologueTransform": extraction}
    if with_compile:
        systems["torch.compile"] = torch.compile(model)
    prologue, whole = {}, {}
    with torch.no_grad():
        expected = model(idx)
        for name, fn in systems.items():
            torch.testing.assert_close(fn(idx), expected)
        for name in ("keraunos", "keraunos + ExtractionOnlyPrologueTransform"):
            entry = keraunos.state_of(systems[name]).last_entry
            prologue[name] = median_time(lambda: entry.prologue_fn(idx), calls * 5)
        if with_compile:
            check = dynamo_guard_check(systems["torch.compile"], type(model).forward.__code__,
                                       {"self": model, "idx": idx, "input_pos": None,
                                        "input_pos_maxp1": None, "lm_head_chunk_size": 0})
            if check is not None:
                prologue["torch.compile (its guards)"] = median_time(check, calls * 5)
        tensors = [idx] + list(model.parameters()) + list(model.buffers())
        loop = reference_check_loop(tensors, [(t.shape, t.dtype, t.device, t.requires_grad)
                                              for t in tensors])
        assert loop()
        reference = median_time(loop, calls * 5)
        for name, fn in systems.items():
            whole[name] = median_time(lambda: fn(idx), calls)
    n_params = sum(1 for _ in model.parameters())
    print(f"\nLlama-3-8B-shaped litgpt GPT ({model.config.n_layer} layers, {n_params} parameter "
          f"tensors, n_embd {model.config.n_embd}), idx (1, 8), no_grad")
    print(f"  reference: plain Python loop checking {len(tensors)} tensors"
          f" {reference * 1e6:10.2f} us")
    print("  prologue alone (ratio to the reference loop)")
    for name, t in prologue.items():
        print(row("  " + name, t, reference))
    print("  whole call (ratio to eager)")
    for name, t in whole.items():
        print(row("  " + name, t, whole["eager"]))
    return prologue, whole, reference


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--skip-compile", action="store_true", help="leave torch.compile out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, keraunos {keraunos.__version__}, 1 thread\n")
    bench_tiny(args.calls, not args.skip_compile)
    bench_symbolic(args.calls)
    bench_llama(max(args.calls // 20, 50), not args.skip_compile)


if __name__ == "__main__":
    main()
