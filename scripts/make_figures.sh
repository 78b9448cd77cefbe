#!/usr/bin/env bash
# Regenerates the figures of docs/ from a small sweep of every attention kind at 1 and 2 ranks (a few minutes on two
# cores): docs/sweep.csv (every run and phase), docs/scaling.png (MHA), docs/scaling_gdn.png, docs/scaling_dsa.png.
# Timings beyond 2 ranks are not meaningful on the 2-core development machine (oversubscribed ranks share cores), so
# the sweep stops at 2; pass RANKS=1,2,4,8 on a machine with the cores for it.
# Environment: SEQPAR_BUILD_DIR (default build; sp_bench must be built), RANKS (default 1,2), SEQS (default 2K,4K),
# ITERS (default 5), OUT (default docs).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${SEQPAR_BUILD_DIR:-$root/build}
ranks=${RANKS:-1,2}
seqs=${SEQS:-2K,4K}
iters=${ITERS:-5}
out=${OUT:-$root/docs}
csv=$out/sweep.csv
load_before=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo "?")
sweep=("$root/scripts/sweep.py" --sp-bench "$build/benchmarks/sp_bench" --ranks "$ranks" --seqs "$seqs"
       --warmup 1 --iters "$iters" --heads 8 --head-dim 64 --out "$csv")
rm -f "$csv"
python3 "${sweep[@]}" --attn mha --kv-heads 8 --causal --algos p2p,allgather,ulysses,usp
python3 "${sweep[@]}" --attn gdn --algos chain,scan,ulysses --append
python3 "${sweep[@]}" --attn dsa --algos ring,allgather,ulysses --append --extra "--topk 256 --indexer-heads 8 --indexer-dim 64"
# plot.py needs matplotlib: Debian's python3-matplotlib (scripts/install_deps.sh) lives in /usr/bin/python3.
py=/usr/bin/python3
[ -x "$py" ] || py=python3
load_after=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo "?")
title="$(OMP_NUM_THREADS= nproc)-core machine, load average $load_before before and $load_after after the sweep (other work shares the cores)"
"$py" "$root/scripts/plot.py" "$csv" --attn mha --out "$out/scaling.png" --title "$title"
"$py" "$root/scripts/plot.py" "$csv" --attn gdn --out "$out/scaling_gdn.png" --title "$title"
"$py" "$root/scripts/plot.py" "$csv" --attn dsa --out "$out/scaling_dsa.png" --title "$title"
