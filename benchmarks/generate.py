"""Text generation: per-token time and compilations of eager, keraunos (with --fusion also
keraunos with the Inductor executor) and torch.compile.

Run: python benchmarks/generate.py [--models llama,gpt2,qwen2,mistral,litgpt] [--tokens N]
     [--prompts 7,11] [--repeats R] [--cache dynamic|static] [--skip-compile]
     [--memory-steps 1000]

Every figure comes from this one run, one intra-op thread, tiny configs with random weights
(nothing downloaded). Per model and system, greedy generation of ``--tokens`` new tokens:
- Hugging Face models: ``model.generate`` with the default ``DynamicCache`` (or
  ``cache_implementation="static"``); keraunos as the README writes it, ``keraunos.jit(model)``
  then its ``generate``; torch.compile as ``model.forward = torch.compile(model.forward)``.
- litgpt: ``litgpt.generate.base.generate`` on a KV-cache GPT (``keraunos.jit(model)``,
  ``torch.compile(model)``).

Columns: ``compiles`` is the compilations of the first generate call of each prompt length
(keraunos: cache misses; torch.compile: the graphs dynamo compiled); ``per token`` the median over
``--repeats`` of (time of a generate of N tokens - time of a generate of 1 token) / (N - 1),
that is a decode step, measured after every prompt length was generated once, the systems taking
turns within each repeat; ratios are to eager and to torch.compile. ``tokens`` says whether every generated sequence equals eager's.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
import warnings

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never touch the network

import torch  # noqa: E402

import keraunos  # noqa: E402

HF_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def hf_model(kind: str):
    import transformers
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                         n_positions=256)
    else:
        config = transformers.AutoConfig.for_model(kind, **HF_TINY)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def litgpt_model():
    import litgpt
    from litgpt.model import GPT
    torch.manual_seed(0)
    config = litgpt.Config(n_layer=2, n_head=4, n_embd=64, vocab_size=128, padded_vocab_size=128,
                           block_size=256)
    return GPT(config).eval()


def dynamo_graphs() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


class System:
    """One way of running generation: ``generate(prompt, n)`` gives the tokens; ``compiles()``
    counts the compilations so far."""

    def __init__(self, generate, compiles):
        self.generate = generate
        self.compiles = compiles


FUSED = ["inductor", "torch"]  # --fusion: keraunos with the Inductor executor too


def hf_systems(kind: str, cache: str, with_compile: bool, fusion: bool = False) -> dict[str, System]:
    options = dict(do_sample=False, pad_token_id=0)
    if cache == "static":
        options["cache_implementation"] = "static"

    def runner(generate):
        def run(prompt, n):
            with torch.no_grad():
                return generate(prompt[None], attention_mask=torch.ones_like(prompt[None]),
                                max_new_tokens=n, min_new_tokens=n, **options)[0]
        return run
    eager = hf_model(kind)
    jitted = keraunos.jit(copy.deepcopy(eager), fuse="off")
    systems = {"eager": System(runner(eager.generate), lambda: 0),
               "keraunos": System(runner(jitted.generate), lambda: keraunos.cache_misses(jitted))}
    if fusion:
        fused = keraunos.jit(copy.deepcopy(eager), executors=FUSED, fuse="wait")
        systems["keraunos+inductor"] = System(runner(fused.generate),
                                              lambda: keraunos.cache_misses(fused))
    if with_compile:
        compiled = copy.deepcopy(eager)
        compiled.forward = torch.compile(compiled.forward)
        systems["torch.compile"] = System(runner(compiled.generate), dynamo_graphs)
    return systems


def litgpt_systems(with_compile: bool, fusion: bool = False) -> dict[str, System]:
    from litgpt.generate.base import generate

    def runner(model, module):
        def run(prompt, n):
            module.max_seq_length = 256  # one size: the KV cache buffers keep their shape
            module.set_kv_cache(batch_size=1)
            return generate(model, prompt, len(prompt) + n, temperature=0.0, top_k=1)
        return run
    eager = litgpt_model()
    jitted_module = copy.deepcopy(eager)
    jitted = keraunos.jit(jitted_module, fuse="off")
    systems = {"eager": System(runner(eager, eager), lambda: 0),
               "keraunos": System(runner(jitted, jitted_module),
                                  lambda: keraunos.cache_misses(jitted))}
    if fusion:
        fused_module = copy.deepcopy(eager)
        fused = keraunos.jit(fused_module, executors=FUSED, fuse="wait")
        systems["keraunos+inductor"] = System(runner(fused, fused_module),
                                              lambda: keraunos.cache_misses(fused))
    if with_compile:
        compiled_module = copy.deepcopy(eager)
        systems["torch.compile"] = System(runner(torch.compile(compiled_module), compiled_module),
                                          dynamo_graphs)
    return systems


def per_token(systems: dict[str, System], prompt: torch.Tensor, tokens: int,
              repeats: int) -> dict[str, float]:
    """Each system's decode step: the median over ``repeats`` of (N-token generate - 1-token
    generate) / (N - 1). The systems take turns within each repeat, so that a change in the
    machine's load (other processes) falls on all of them alike, not on whichever ran then."""
    for system in systems.values():
        system.generate(prompt, 1)  # a 1-token generate (a static cache of another length) may
        system.generate(prompt, tokens)  # compile: warm both up before timing
    samples: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(repeats):
        for name, system in systems.items():
            t0 = time.perf_counter()
            system.generate(prompt, 1)
            t1 = time.perf_counter()
            system.generate(prompt, tokens)
            t2 = time.perf_counter()
            samples[name].append(((t2 - t1) - (t1 - t0)) / max(tokens - 1, 1))
    return {name: statistics.median(times) for name, times in samples.items()}


def bench(name: str, systems: dict[str, System], prompts: list[int], tokens: int,
          repeats: int) -> dict:
    """system -> (compiles per prompt, tokens equal to eager's (or the error), seconds per
    token or None)."""
    torch.manual_seed(1)
    prompt_ids = [torch.randint(1, 128, (n,)) for n in prompts]
    reference = [systems["eager"].generate(p, tokens).tolist() for p in prompt_ids]
    print(f"\n{name}: prompts {prompts}, {tokens} new tokens, per token = one decode step")
    print(f"  {'system':<17} {'compiles per prompt':<22} {'tokens':<7} {'per token':>12} "
          f"{'vs eager':>9} {'vs torch.compile':>17}")
    rows, working = {}, {}
    for system_name, system in systems.items():
        compiles, same = [], True
        try:
            for p, ref in zip(prompt_ids, reference):
                before = system.compiles()
                same &= system.generate(p, tokens).tolist() == ref
                compiles.append(system.compiles() - before)
            rows[system_name] = (compiles, same, None)
            working[system_name] = system
        except Exception as e:  # noqa: BLE001 - one system failing never stops the run
            rows[system_name] = (compiles, f"{type(e).__name__}", None)
    times = per_token(working, prompt_ids[-1], tokens, repeats)
    rows = {name: (compiles, same, times.get(name)) for name, (compiles, same, _) in rows.items()}
    eager_t = rows["eager"][2]
    compile_t = rows.get("torch.compile", (None, None, None))[2]
    for system_name, (compiles, same, t) in rows.items():
        verdict = same if isinstance(same, str) else ("equal" if same else "DIFFER")
        if t is None:
            print(f"  {system_name:<17} {str(compiles):<22} {verdict:<7}")
            continue
        vs_eager = f"{t / eager_t:8.2f}x" if eager_t else ""
        vs_compile = f"{t / compile_t:16.2f}x" if compile_t else ""
        print(f"  {system_name:<17} {str(compiles):<22} {verdict:<7} {t * 1e3:9.3f} ms "
              f"{vs_eager:>9} {vs_compile:>17}")
    return rows


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:  # Linux: resident pages are the second field
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_over_steps(steps: int) -> None:
    """Memory over ``steps`` decode steps of a litgpt KV-cache GPT whose cache holds every
    position (fixed-size buffers: nothing should grow), eager and keraunos in turn: Python's
    allocated blocks (``sys.getallocatedblocks``) and the process's resident memory, after a
    warm-up of 20 steps and at the end, per step."""
    import gc
    import sys
    import litgpt
    from litgpt.model import GPT
    torch.manual_seed(0)
    config = litgpt.Config(n_layer=2, n_head=4, n_embd=64, vocab_size=128, padded_vocab_size=128,
                           block_size=steps + 32)
    eager = GPT(config).eval()
    jitted_module = copy.deepcopy(eager)
    systems = {"eager": (eager, eager), "keraunos": (keraunos.jit(jitted_module, fuse="off"), jitted_module)}
    print(f"\nmemory over {steps} decode steps (litgpt KV cache of {steps + 32} positions)")
    print(f"  {'system':<10} {'blocks/step':>12} {'RSS bytes/step':>15} {'compiles':>9}")
    for name, (model, module) in systems.items():
        module.max_seq_length = steps + 32
        module.set_kv_cache(batch_size=1)
        token = torch.tensor([[3]])
        with torch.no_grad():
            for p in range(20):
                model(token, input_pos=torch.tensor([p]), input_pos_maxp1=p + 1)
            gc.collect()
            blocks, rss = sys.getallocatedblocks(), rss_bytes()
            for p in range(20, 20 + steps):
                model(token, input_pos=torch.tensor([p]), input_pos_maxp1=p + 1)
            gc.collect()
        compiles = keraunos.cache_misses(model) if name == "keraunos" else 0
        print(f"  {name:<10} {(sys.getallocatedblocks() - blocks) / steps:12.2f} "
              f"{(rss_bytes() - rss) / steps:15.1f} {compiles:9d}")


def write_json(results: dict, path: str) -> None:
    """The table as benchmarks/report.py renders it: one row per model and system."""
    import json
    rows = []
    for model, systems in results.items():
        eager_t = systems["eager"][2]
        compile_t = systems.get("torch.compile", (None, None, None))[2]
        for system, (compiles, same, t) in systems.items():
            verdict = same if isinstance(same, str) else ("equal" if same else "DIFFER")
            rows.append([f"{model}: {system}", " ".join(map(str, compiles)), verdict,
                         f"{t * 1e3:.3f} ms" if t else "-",
                         f"{t / eager_t:.2f}x" if t and eager_t else "-",
                         f"{t / compile_t:.2f}x" if t and compile_t else "-"])
    with open(path, "w") as f:
        json.dump({"tables": [{"columns": ["model: system", "compiles per prompt",
                                           "tokens vs eager", "per token", "vs eager",
                                           "vs torch.compile"],
                               "rows": rows, "ratios_to": "eager"}]}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="llama,gpt2,qwen2,mistral,litgpt")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompts", default="7,11,16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cache", choices=["dynamic", "static"], default="dynamic")
    parser.add_argument("--skip-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument("--fusion", action="store_true",
                        help="also keraunos with the Inductor executor (keraunos+inductor)")
    parser.add_argument("--memory-steps", type=int, default=0,
                        help="also measure memory over this many decode steps (e.g. 1000)")
    parser.add_argument("--json", default="", help="also write the table to this JSON file "
                        "(what benchmarks/report.py renders)")
    parser.add_argument("--quick", action="store_true",
                        help="4 tokens, 2 prompts, 1 repeat: proves every path runs, measures "
                        "nothing")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.prompts, args.repeats = 4, "7,11", 1
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # transformers' generation-config notices
    prompts = [int(n) for n in args.prompts.split(",")]
    print(f"torch {torch.__version__}, keraunos {keraunos.__version__}, 1 thread, "
          f"{args.cache} cache (Hugging Face models)")
    results = {}
    for model in filter(None, args.models.split(",")):  # --models "" runs none
        if model == "litgpt":
            systems = litgpt_systems(not args.skip_compile, args.fusion)
        else:
            systems = hf_systems(model, args.cache, not args.skip_compile, args.fusion)
        results[model] = bench(model, systems, prompts, args.tokens, args.repeats)
    if args.json:
        write_json(results, args.json)
    if args.memory_steps:
        memory_over_steps(args.memory_steps)


if __name__ == "__main__":
    main()
