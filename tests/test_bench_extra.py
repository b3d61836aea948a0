"""`keraunos bench` without its extra says which extra to install, once."""
import subprocess
import sys

RUN_BENCH = """
import sys
sys.modules[{module!r}] = None  # as if it were not installed: importing it raises ImportError
from keraunos import cli
sys.exit(cli.main({argv!r}))
"""


def bench_without(module: str, argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUN_BENCH.format(module=module, argv=argv)],
                          capture_output=True, text=True, timeout=300)


def test_bench_without_litgpt_names_the_extra_in_one_line():
    done = bench_without("litgpt", ["bench", "--quick", "--workloads", "a,b,c", "--chart", ""])
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "pip install 'keraunos[bench]'" in lines[0]
    assert "ModuleNotFoundError" not in done.stderr + done.stdout


def test_bench_tiers_on_a_litgpt_model_without_litgpt_names_the_extra():
    done = bench_without("litgpt", ["bench", "tiers", "--model", "llama32", "--quick"])
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'keraunos[bench]'" in lines[0], done.stderr
    assert "ModuleNotFoundError" not in done.stderr + done.stdout
