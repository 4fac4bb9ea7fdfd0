#!/usr/bin/env bash
# Wheels a GPU machine without a package registry lacks, downloaded here into .whl/ (git-ignored)
# for its Python 3.12 on x86-64 Linux; bench/gpu_check.py (`make gpu-check`) installs them there
# into /tmp/site with pip, offline.
#   torchao 0.17.0: float8 training (the benchmark's float8 variant). Its CUDA extensions are
#     built per torch release; 0.17.0 is the release built against torch 2.11 (stable ABI, the
#     GPU machine's torch), and its import refuses the extensions below 2.11. Its wheel names
#     no requirements.
#   liger-kernel 0.8.5: the fused kernels bench/kernel_speed.py compares forja's against; pure Python
#     on Triton. It requires torch and triton, which the machine has: --no-deps, so nothing
#     else (above all no second torch) is downloaded.
#   fla-core 0.6.0: flash-linear-attention's Triton kernels (fla.ops), which Gated DeltaNet layers
#     take on CUDA (tests/gpu/test_gated_deltanet_cuda.py); pure Python, requires only einops,
#     which the machine has.
#   torchtitan 0.3.0 and what it needs beyond the machine's packages (pure Python, about 4 MB),
#     in .whl/peers/: bench/peers.py installs them offline into its side environment.
# Usage: scripts/gpu_wheels.sh   (from anywhere; prints the folder's size, which travels with the repo)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
WHEELS=(torchao==0.17.0 liger-kernel==0.8.5 fla-core==0.6.0)
mkdir -p .whl
# One version of each: two of the same package stop the offline install.
rm -f .whl/torchao-*.whl .whl/liger_kernel-*.whl .whl/fla_core-*.whl
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${WHEELS[@]}"
"$PY" bench/peers_env.py --download .whl/peers
ls -l .whl .whl/peers
echo "total: $(du -sh .whl | cut -f1) in .whl/ (travels with the repository: keep the whole under 64 MiB)"
