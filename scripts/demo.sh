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
# 4 ranks on fewer cores is deliberate here (the checks are the demo, not the times): said once below, instead of
# sp_bench's two lines per run (on stderr at its start, in its table's header).
cores=$(getconf _NPROCESSORS_ONLN)  # sp_bench's count (online CPUs)
if [ "$cores" -lt "$np" ]; then
  echo "demo: $np ranks on $cores cores, oversubscribed on purpose: the times below are not meaningful, the checks" \
    "against the single-rank reference are"
fi
run() {
  mpirun -np "$np" "${sp_bench[@]}" "$@" 2>&1 |
    grep --line-buffered -v -e '^sp_bench: warning: ranks per node' -e '^# warning: ranks per node'
}

echo "== MHA: llama3-8b heads (32 q, 8 kv, D 128), USP 2x2, zigzag, causal, 2K tokens =="
run --model llama3-8b --seq 2K
echo
echo "== GDN: qwen3-next heads, USP 2x2, scan state passing, 2K tokens =="
run --model qwen3-next --gdn-mode scan --seq 2K
echo
echo "== DSA: deepseek-v3.2 shapes, USP 2x2, top-k 256, 1K tokens =="
run --model deepseek-v3.2 --topk 256 --seq 1K
