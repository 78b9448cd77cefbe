#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job: sp_bench under mpirun at 4 ranks (Ulysses 2 x ring 2),
# MHA, GDN and DSA at small real-model shapes, each checked against the single-rank reference of the same problem.
set -euo pipefail
# Only what the demo runs: sp_bench, and comm_bench for common.sh's probe of OpenMPI's shared-memory copies (the tests
# and the Python module are test.sh's; the demo pip-installs nothing).
build_targets=(sp_bench comm_bench)
skip_python=1
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
np=4
sp_bench=("$build_dir/benchmarks/sp_bench" --ulysses-size 2 --ring-size 2 --layout zigzag --warmup 1 --iters 2 --check)

echo "== MHA: llama3-8b heads (32 q, 8 kv, D 128), USP 2x2, zigzag, causal, 2K tokens =="
mpirun -np "$np" "${sp_bench[@]}" --model llama3-8b --seq 2K
echo
echo "== GDN: qwen3-next heads, USP 2x2, scan state passing, 2K tokens =="
mpirun -np "$np" "${sp_bench[@]}" --model qwen3-next --gdn-mode scan --seq 2K
echo
echo "== DSA: deepseek-v3.2 shapes, USP 2x2, top-k 256, 1K tokens =="
mpirun -np "$np" "${sp_bench[@]}" --model deepseek-v3.2 --topk 256 --seq 1K
