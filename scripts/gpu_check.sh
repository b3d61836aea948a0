#!/usr/bin/env bash
# The CUDA checks, for the day a GPU machine is at hand (within 8 minutes on one GPU): set up,
# the CUDA tests (tests/test_cuda.py: fused Triton regions, the tier switch, dropout on CUDA's
# generator, a litgpt training step, resnet18, a training step under CUDA autocast), the tier tests and, with two GPUs, DDP's
# bucket-split backward on NCCL (tests/test_distributed_cuda.py), then the tiers benchmark on the
# GPU (first result, all fused, restart, per call against regional and async torch.compile).
# Prints everything; the exit code is the tests'. On a CUDA machine, install the CUDA build of
# torch 2.13 first (scripts/setup.sh installs whatever `pip install torch==2.13.0` finds).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
.venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else \
  'gpu_check.sh: torch sees no CUDA device (torch ' + torch.__version__ + ')')" || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
timeout 300 .venv/bin/python -m pytest -q -p no:warnings -rs tests/test_cuda.py tests/test_tiers.py \
  tests/test_distributed_cuda.py
status=$?
timeout 150 .venv/bin/python benchmarks/tiers.py --device cuda --model gpt --calls 50 \
  --systems eager,keraunos,keraunos-torch,regional,compile || echo "gpu_check.sh: the benchmark failed"
exit "$status"
