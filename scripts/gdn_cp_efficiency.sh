#!/usr/bin/env bash
# GDN context parallelism at 2 ranks: parallel efficiency of the forward and the backward, "alone" and "busy"
# (sp_bench --efficiency; docs/benchmarks.md, "Definitions of the benchmark figures"), on the configurations of
# docs/results.md, "GDN context parallelism at 2 ranks", in ROUNDS rounds (each configuration once per round, the
# configurations interleaved); prints a markdown table of the medians and the best over the rounds, and the exposed
# communication share. Meant for a quiet machine: it notes the load average before each run.
#
#   scripts/gdn_cp_efficiency.sh            # the 4 configurations of the quiet-machine table, 3 rounds (~3 min)
#   FULL=1 scripts/gdn_cp_efficiency.sh     # all 12: Qwen3-Next and Hv 8 / Hk 4 at D 128 and 64, x zigzag and
#                                           # contiguous x chain and scan (Qwen3-Next: zigzag scan and chain,
#                                           # contiguous scan and chain)
#   HV8=1 scripts/gdn_cp_efficiency.sh      # only the 8 Hv 8 / Hk 4 configurations
#   ONLY=Qwen scripts/gdn_cp_efficiency.sh  # only the configurations whose name matches the (grep -E) pattern
#   AB=1 scripts/gdn_cp_efficiency.sh       # each run twice, without and with the work ahead (SEQPAR_GDN_WORK_AHEAD
#                                           # 0 then 1, back to back): a table per setting
#   AB=1 AB_VAR=SEQPAR_GDN_DEFER_COPIES scripts/gdn_cp_efficiency.sh   # the same for another 0 / 1 knob
#   AB=1 AB_VAR=SEQPAR_GDN_LEAN_BACKWARD scripts/gdn_cp_efficiency.sh  # (the backward's copies and key-head sums)
#
# Environment: SEQPAR_BUILD_DIR (default build; sp_bench must be built), ROUNDS (3), SEQ (8192), ITERS (3),
# FULL (0), HV8 (0), ONLY (all), AB (0), AB_VAR (SEQPAR_GDN_WORK_AHEAD), MPIRUN_ARGS (extra mpirun flags, e.g.
# --allow-run-as-root), KEEP_JSON (a directory: every run's sp_bench JSON is kept there, CONFIG.ROUND.SETTING.json,
# CONFIG the configuration's index; default: a temporary directory, removed), OPENBLAS_CORETYPE (default SkylakeX,
# OpenBLAS's AVX-512 kernels, where the CPU has AVX-512; elsewhere OpenBLAS's own choice).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${SEQPAR_BUILD_DIR:-$root/build}
bench=$build_dir/benchmarks/sp_bench
rounds=${ROUNDS:-3}
seq=${SEQ:-8192}
iters=${ITERS:-3}
[ -x "$bench" ] || { echo "gdn_cp_efficiency.sh: $bench not found: build the sp_bench target first" >&2; exit 2; }
command -v python3 >/dev/null || { echo "gdn_cp_efficiency.sh: needs python3 (to read the JSON)" >&2; exit 2; }

qwen="--model qwen3-next --conv-width 0"
hv8_128="--heads 8 --kv-heads 4 --head-dim 128"
hv8_64="--heads 8 --kv-heads 4 --head-dim 64"
# name|shape flags|layout|mode
configs=(
  "Qwen3-Next, zigzag, scan|$qwen|zigzag|scan"
  "Qwen3-Next, contiguous, chain|$qwen|contiguous|chain"
  "Hv 8 / Hk 4, D 128, zigzag, scan|$hv8_128|zigzag|scan"
  "Hv 8 / Hk 4, D 64, contiguous, chain|$hv8_64|contiguous|chain"
)
if [ "${FULL:-0}" = 1 ]; then
  configs+=(
    "Qwen3-Next, contiguous, scan|$qwen|contiguous|scan"
    "Qwen3-Next, zigzag, chain|$qwen|zigzag|chain"
    "Hv 8 / Hk 4, D 64, zigzag, scan|$hv8_64|zigzag|scan"
    "Hv 8 / Hk 4, D 128, contiguous, chain|$hv8_128|contiguous|chain"
    "Hv 8 / Hk 4, D 128, zigzag, chain|$hv8_128|zigzag|chain"
    "Hv 8 / Hk 4, D 64, zigzag, chain|$hv8_64|zigzag|chain"
    "Hv 8 / Hk 4, D 128, contiguous, scan|$hv8_128|contiguous|scan"
    "Hv 8 / Hk 4, D 64, contiguous, scan|$hv8_64|contiguous|scan"
  )
fi
if [ "${HV8:-0}" = 1 ]; then
  configs=()
  for d in 128 64; do
    for lm in "zigzag scan" "zigzag chain" "contiguous scan" "contiguous chain"; do
      read -r layout mode <<<"$lm"
      configs+=("Hv 8 / Hk 4, D $d, $layout, $mode|--heads 8 --kv-heads 4 --head-dim $d|$layout|$mode")
    done
  done
fi
if [ -n "${ONLY:-}" ]; then
  kept=()
  for c in "${configs[@]}"; do
    if grep -qE -- "$ONLY" <<<"${c%%|*}"; then kept+=("$c"); fi
  done
  configs=("${kept[@]}")
  [ ${#configs[@]} -gt 0 ] || { echo "gdn_cp_efficiency.sh: no configuration matches ONLY=$ONLY" >&2; exit 2; }
fi
# The settings of AB_VAR (default SEQPAR_GDN_WORK_AHEAD) each configuration runs with; "-": the default.
ab_var=${AB_VAR:-SEQPAR_GDN_WORK_AHEAD}
[[ $ab_var =~ ^SEQPAR_[A-Z0-9_]+$ ]] || { echo "gdn_cp_efficiency.sh: AB_VAR=$ab_var must be a SEQPAR_ variable" >&2; exit 2; }
settings=(-)
[ "${AB:-0}" = 1 ] && settings=(0 1)

if [ -n "${KEEP_JSON:-}" ]; then
  out=$KEEP_JSON
  mkdir -p "$out"
else
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
coretype=()
if [ -n "${OPENBLAS_CORETYPE:-}" ]; then
  coretype=("OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE")
elif grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
  coretype=(OPENBLAS_CORETYPE=SkylakeX)
fi
echo "# gdn_cp_efficiency.sh: S $seq, 2 ranks, 1 thread each, $rounds rounds x ${#configs[@]} configurations," \
  "$iters timed iterations per run; commit $(git -C "$root" describe --always --dirty 2>/dev/null || echo unknown)," \
  "$(date -u +%FT%TZ), $(OMP_NUM_THREADS= nproc) cores ($(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo |
    head -1)), ${coretype[*]:-OpenBLAS choosing its kernels}"
for ((r = 1; r <= rounds; ++r)); do
  for i in "${!configs[@]}"; do
    IFS='|' read -r name shape layout mode <<<"${configs[$i]}"
    for a in "${settings[@]}"; do
      load=$(cut -d' ' -f1 /proc/loadavg)
      echo "# round $r, $name, $ab_var ${a/-/default} (load $load)" >&2
      env_ahead=()
      [ "$a" != - ] && env_ahead=("$ab_var=$a")
      # shellcheck disable=SC2086
      env "${env_ahead[@]}" "${coretype[@]}" mpirun -np 2 --oversubscribe \
        ${MPIRUN_ARGS:-} "$bench" --attn gdn $shape --seq "$seq" --ring-size 2 --layout "$layout" --gdn-mode "$mode" \
        --threads 1 --iters "$iters" --warmup 1 --efficiency --json "$out/$i.$r.$a.json" >/dev/null
      echo "$load" >"$out/$i.$r.$a.load"
    done
  done
done

for a in "${settings[@]}"; do
[ "$a" != - ] && printf '\n%s=%s:\n\n' "$ab_var" "$a"
python3 - "$out" "$rounds" "$seq" "$a" "${configs[@]}" <<'EOF'
import json, statistics, sys
out, rounds, seq, setting, configs = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]
print("| configuration (S %s, 2 ranks) | rounds | fwd alone / busy, median (best) | bwd alone / busy, median (best) "
      "| exposed comm fwd / bwd | load |" % seq)
print("|---|---|---|---|---|---|")
for i, c in enumerate(configs):
    name = c.split("|")[0]
    runs = [json.load(open(f"{out}/{i}.{r}.{setting}.json")) for r in range(1, rounds + 1)]
    loads = [float(open(f"{out}/{i}.{r}.{setting}.load").read()) for r in range(1, rounds + 1)]
    def phase(run, p):
        return next(x for x in run["phases"] if x["phase"] == p)
    cells = []
    for p in ("fwd", "bwd"):
        a = [phase(x, p)["efficiency"] for x in runs]
        b = [phase(x, p)["efficiency_busy"] for x in runs]
        cells.append("%.2f / %.2f (%.2f / %.2f)" % (statistics.median(a), statistics.median(b), max(a), max(b)))
    exp = ["%.0f %%" % statistics.median([phase(x, p)["exposed_comm_pct"] for x in runs]) for p in ("fwd", "bwd")]
    print("| %s | %d | %s | %s | %s | %.1f to %.1f |" % (name, rounds, cells[0], cells[1], " / ".join(exp),
                                                        min(loads), max(loads)))
EOF
done
