#!/usr/bin/env bash
# The one prepared GPU check: run it once on a machine with a CUDA GPU, read the summary, fix, rerun.
#
#   scripts/gpu_check.sh [--dry-run] [--out DIR] [--build-dir DIR] [--jobs N]
#
# Phases, in order; each writes its log (DIR/<n>-<phase>.log) before the next starts, the check stops at the first
# phase that fails, and a summary table (phase, status, seconds, log) is printed last:
#   probe     versions (OS, cores, CMake, nvcc, driver, PyTorch, MPI, compute-sanitizer, cuDNN frontend), configure,
#             then device_probe: the device's properties as JSON, saved as test data (DIR/device_properties.json,
#             and on a GPU tests/data/device_properties/<device name>.json in the checkout, to commit)
#   build     only the targets the later phases run
#   kernels   the attention kernels on the device against CPU fp64 references (test_device_attention with
#             SEQPAR_TEST_DEVICE; bf16 ~1e-2, fp16 ~3e-3 relative), the host-device row bodies, cuDNN support
#   ops       the ops table (test_ops_table: every op against fp64 loops; on a GPU the CUDA table's cases must run,
#             none skipped) and the GDN forward / DSA indexer and attention composed from it (test_gdn_composed,
#             test_dsa_composed) on the table of SEQPAR_TEST_DEVICE: the CUDA table on a GPU, the CPU table in the dry
#             run; the existing GDN tests (test_gdn, test_gdn_packed, test_gdn_conv) and DSA tests (test_dsa,
#             test_dsa_packed_kernel) routed through that composition (SEQPAR_LOWERED_ATTENTION=1; a route that finds
#             no CUDA table skips its run with the reason, which fails the phase)
#   cpops     the GDN and DSA CP tests (test_gdn_cp, test_gdn_cp_packed, test_dsa_cp, test_dsa_packed) at 2 and 4 ranks
#             on the one device, every kernel call composed on the table of SEQPAR_TEST_DEVICE (the ranks share the
#             GPU; their messages go through MPI on the host), their cases that compare against the one-rank result;
#             skipped with the reason when mpirun is missing (MPI may not be installed on the GPU machine)
#   sanitize  compute-sanitizer memcheck and racecheck on the custom kernels at tiny shapes (*Tiny* cases); memcheck
#             on the CUDA ops table's cases
#   bench     kernel_bench --device: attention forward and backward at S 4K/16K/64K, D 128, causal and not, against a
#             cuBLAS bf16 GEMM timed in the same run; PyTorch's SDPA on the same shapes (scripts/sdpa_bench.py)
#   opsbench  ops_bench --table cuda: the composed GDN forward and backward at Qwen3-Next's shapes (S 8K and 64K;
#             Hv 32 on Hk 16, K = V = 128, chunk 64) and the DSA stages (indexer + top-k, sparse attention; S 4K,
#             H 16, k 2048), each with the time of its host transfers alone and its model FLOP rate over a 4096^3 fp32
#             cuBLAS GEMM's; each DSA stage against its floor, max(FLOPs at that GEMM's rate, bytes read and written
#             once at the bandwidth of a device-to-device copy through the table); then fla's chunk GDN forward and
#             backward at the same shapes in bf16 (scripts/gdn_fla_bench.py, fla from .deps/fla), with composed / fla
#             per direction, when PyTorch, a device and fla are there, else a skip line with the reason
#   cp        sp_bench --check at 2 and 4 ranks on the one device (MPI communicator with device staging) against
#             one rank (ring and USP, zigzag, causal; MHA only): last, since the CP layers' device path is the
#             newest code and has never run on a GPU
# Budget: 360 s on 16 cores with one H200 (unmeasured: no GPU has run it), the sum of the phases' time limits
# (SEQPAR_GPU_CHECK_<PHASE>_S overrides): probe 90 s (configure, and device_probe, which compiles the cuDNN
# frontend's translation unit, ~2 minutes alone on a slow machine), build 95 (the CUDA ops table's CUB sorts are one
# translation unit of their own), kernels 20, ops 20, cpops 25, sanitize 20, bench 20, opsbench 60 (S 8K and
# 64K, forward and backward, the composed calls' host transfers of GBs included, ~30 GB of host and device memory at
# 64K by the CPU table's growth; Triton compiles and autotunes fla's forward and backward kernels in its warm-ups;
# unmeasured), cp 10.
#
# --dry-run runs the same phases with the CPU device at tiny shapes (the CPU build, the CPU tests, the same
# commands with --device cpu; compute-sanitizer is replaced by the plain run of the same cases; each limit 60 s
# longer), so that the script itself is tested (ctest gpu_check.dry_run). Nothing is installed: what a CUDA build
# needs beyond the CUDA toolkit, CMake and PyTorch travels in the checkout's ignored .deps/
# (scripts/install_gpu_deps.sh, run before copying the checkout to the GPU machine). MPI may be missing there: then the
# cpops phase is skipped with the reason and the cp phase fails and says so.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dry_run=0
out=""
build_dir=""
jobs=$(OMP_NUM_THREADS= nproc)
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --out) out=$2; shift ;;
    --build-dir) build_dir=$2; shift ;;
    --jobs) jobs=$2; shift ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ "$dry_run" = 1 ]; then
  device=cpu
  build_dir=${build_dir:-$root/build}
  out=${out:-$build_dir/gpu_check_dry_run}
else
  device=cuda
  build_dir=${build_dir:-$root/build-gpu-check}
  out=${out:-$root/out/gpu_check-$(date -u +%Y%m%d-%H%M%S)}
fi
mkdir -p "$out" || { echo "gpu_check: cannot create $out" >&2; exit 2; }
out=$(cd "$out" && pwd)
bin=$build_dir
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1

# ---- shapes: the GPU's, or the dry run's tiny ones ----
if [ "$dry_run" = 1 ]; then
  kb_args=(--device cpu --kernel mha --seq 128 --dim 32 --hq 2 --hkv 1 --min-time 0.05 --warmup 0 --square 64)
  sdpa_args=(--device cpu --seq 128 --dim 32 --hq 2 --hkv 1 --min-time 0.02)
  sp_shape=(--seq 64 --heads 2 --kv-heads 1 --head-dim 16)
  kernel_filter='*Tiny*:*d128*:*fp64*'
  ob_args=(--table cpu --gdn-seq 256 --heads 4 --kv-heads 2 --head-dim 32 --dim-v 32 --dsa-seq 256 --dsa-heads 2
           --dsa-dim 64 --dsa-dim-v 32 --indexer-heads 4 --indexer-dim 16 --topk 32 --square 128 --min-time 0.02
           --warmup 0 --copy-mb 8)
  fla_args=(--dry-run --seq 256 --heads 4 --kv-heads 2 --head-dim 32 --dim-v 32)
else
  kb_args=(--device cuda --kernel mha --seq 4096,16384,65536 --dim 128 --hq 16 --hkv 4 --min-time 0.5)
  sdpa_args=(--device cuda --seq 4096,16384,65536 --dim 128 --hq 16 --hkv 4 --min-time 0.5)
  sp_shape=(--seq 4096 --heads 8 --kv-heads 2 --head-dim 128 --dtype bf16)
  kernel_filter='*'
  ob_args=(--table cuda --gdn-seq 8192,65536 --heads 32 --kv-heads 16 --head-dim 128 --dim-v 128
           --chunk-size 64 --dsa-seq 4096 --dsa-heads 16 --topk 2048 --square 4096 --min-time 0.1 --warmup 1)
  fla_args=(--seq 8192,65536 --heads 32 --kv-heads 16 --head-dim 128 --dim-v 128 --dtypes bf16
            --min-time 0.1 --warmup 2)
fi

phases=()
statuses=()
seconds=()
logs=()
n=0

# run_phase NAME LIMIT_S FUNCTION: runs FUNCTION with its output in DIR/<n>-NAME.log (and on the terminal), under a
# time limit; records the result; exits after the summary when it fails.
run_phase() {
  local name=$1 limit=$2 fn=$3
  n=$((n + 1))
  local log="$out/$n-$name.log" t0 rc
  t0=$(date +%s)
  echo "== gpu_check: phase $n $name (device $device, limit ${limit}s; log $log)"
  # shellcheck disable=SC2034
  ( export -f "$fn"; timeout --kill-after=10 "$limit" bash -c "set -o pipefail; $fn" ) > "$log" 2>&1
  rc=$?
  cat "$log"
  phases+=("$name")
  seconds+=($(( $(date +%s) - t0 )))
  logs+=("$log")
  if [ "$rc" = 0 ]; then
    statuses+=(pass)
  elif [ "$rc" = 77 ]; then  # the phase cannot run here and has said why (its log)
    statuses+=(skipped)
  else
    [ "$rc" = 124 ] && statuses+=("timeout") || statuses+=("FAIL rc=$rc")
    summary
    exit 1
  fi
}

summary() {
  {
    echo
    echo "# gpu_check summary: device $device$([ "$dry_run" = 1 ] && echo ' (dry run)'), $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git -C "$root" describe --always --dirty 2>/dev/null || echo unknown)"
    printf "%-3s %-9s %-12s %7s  %s\n" "#" phase status seconds log
    local i
    for i in "${!phases[@]}"; do
      printf "%-3s %-9s %-12s %7s  %s\n" $((i + 1)) "${phases[$i]}" "${statuses[$i]}" "${seconds[$i]}" "${logs[$i]}"
    done
    local all=(probe build kernels ops cpops sanitize bench opsbench cp)
    for ((i = ${#phases[@]}; i < ${#all[@]}; i++)); do
      printf "%-3s %-9s %-12s %7s  %s\n" $((i + 1)) "${all[$i]}" "not run" - -
    done
  } | tee "$out/summary.txt"
}

# ---- the phases (run in a child bash: they see the exported variables below) ----
export root out build_dir bin jobs device dry_run kernel_filter
export kb_args_s="${kb_args[*]}" sdpa_args_s="${sdpa_args[*]}" sp_shape_s="${sp_shape[*]}"
export ob_args_s="${ob_args[*]}" fla_args_s="${fla_args[*]}"

probe() {
  echo "# host: $(uname -srm), $(OMP_NUM_THREADS= nproc) cores, $(date -u)"
  echo "# cmake: $(cmake --version | head -1)"
  echo "# c++: $(c++ --version 2>/dev/null | head -1)"
  echo "# nvcc: $(command -v nvcc >/dev/null && nvcc --version | tail -1 || echo none)"
  echo "# nvidia-smi: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo none)"
  # (importing torch takes seconds: the dry run reads its version from the package metadata only)
  local torch_probe='import torch; print(torch.__version__, "cuda available:", torch.cuda.is_available())'
  [ "$dry_run" = 1 ] && torch_probe='import importlib.metadata as m; print(m.version("torch"))'
  echo "# python: $(python3 --version 2>&1), torch $(python3 -c "$torch_probe" 2>/dev/null || echo none)"
  echo "# mpirun: $(command -v mpirun >/dev/null && mpirun --version 2>&1 | head -1 || echo none)"
  echo "# compute-sanitizer: $(command -v compute-sanitizer >/dev/null && compute-sanitizer --version | tail -1 || echo none)"
  echo "# cuDNN frontend: $(cat "$root/.deps/cudnn_frontend/VERSION" 2>/dev/null || echo none) (.deps/)"
  echo "# FlashInfer top-k headers: $(cat "$root/.deps/flashinfer/VERSION" 2>/dev/null || echo "none: fp32 topk_rows on CUB's sort") (.deps/)"
  # what the configure step requires besides the toolkit (MPI, OpenMP, BLAS, nlohmann_json, cxxopts, GTest): a
  # missing one stops the configure below, and this line says which
  local h missing=()
  for h in mpi.h cblas.h nlohmann/json.hpp cxxopts.hpp gtest/gtest.h; do
    [ -n "$(find /usr/include /usr/local/include /usr/lib/x86_64-linux-gnu/openmpi/include -maxdepth 2 -path "*$h" 2>/dev/null | head -1)" ] ||
      missing+=("$h")
  done
  echo "# headers the configure needs: ${missing[*]:+missing ${missing[*]}}${missing[*]:-all found}"
  if [ "$dry_run" = 0 ]; then
    nvidia-smi >/dev/null 2>&1 || { echo "gpu_check: nvidia-smi finds no GPU (is this the GPU machine?)"; exit 1; }
    [ -f "$root/.deps/cudnn_frontend/include/cudnn_frontend.h" ] ||
      { echo "gpu_check: no cuDNN frontend in .deps/: run scripts/install_gpu_deps.sh before copying the checkout"; exit 1; }
  fi
  if [ ! -f "$build_dir/CMakeCache.txt" ]; then
    local gen=()
    command -v ninja >/dev/null && gen=(-G Ninja)
    local cuda=(-DSEQPAR_WITH_CUDA=OFF)
    [ "$dry_run" = 0 ] && cuda=(-DSEQPAR_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DSEQPAR_BUILD_PYTHON=OFF)
    cmake -S "$root" -B "$build_dir" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release "${cuda[@]}" || exit 1
  fi
  cmake --build "$build_dir" -j "$jobs" --target device_probe || exit 1
  "$bin/benchmarks/device_probe" --device "$device" --out "$out/device_properties.json" || exit 1
  cat "$out/device_properties.json"
  if [ "$dry_run" = 0 ]; then
    local name
    name=$(python3 -c 'import json,sys,re; print(re.sub("[^A-Za-z0-9]+","_",json.load(open(sys.argv[1]))["deviceName"]).strip("_"))' "$out/device_properties.json")
    mkdir -p "$root/tests/data/device_properties"
    cp "$out/device_properties.json" "$root/tests/data/device_properties/$name.json"
    echo "# saved as tests/data/device_properties/$name.json"
  fi
}

build() {
  local targets=(device_probe test_device_attention test_row_ops test_cudnn_sdpa_support kernel_bench sp_bench
                 test_ops_table test_gdn_composed test_dsa_composed test_gdn test_gdn_packed test_gdn_conv ops_bench
                 test_dsa test_dsa_packed_kernel test_gdn_cp test_gdn_cp_packed test_dsa_cp test_dsa_packed)
  cmake --build "$build_dir" -j "$jobs" --target "${targets[@]}"
}

kernels() {
  local t="$bin/tests/unit"
  SEQPAR_TEST_DEVICE=$device OMP_NUM_THREADS=2 "$t/test_device_attention" --gtest_filter="$kernel_filter" |
    tee "$out/test_device_attention.txt" || exit 1
  # a skip would hide that nothing ran on the device: every case must run
  if grep -q "SKIPPED \]" "$out/test_device_attention.txt"; then
    echo "gpu_check: test_device_attention skipped cases on $device"
    exit 1
  fi
  OMP_NUM_THREADS=2 "$t/test_row_ops" --gtest_brief=1 || exit 1
  "$t/test_cudnn_sdpa_support" --gtest_brief=1 || exit 1
}

ops() {
  local t="$bin/tests/unit"
  SEQPAR_TEST_DEVICE=$device OMP_NUM_THREADS=2 "$t/test_ops_table" | tee "$out/test_ops_table.txt" || exit 1
  # on a GPU every CUDA-table case must run (a skip would hide that nothing ran on the device)
  if [ "$dry_run" = 0 ] && grep -q "SKIPPED \]" "$out/test_ops_table.txt"; then
    echo "gpu_check: test_ops_table skipped cases on $device"
    exit 1
  fi
  # the compositions on the table of SEQPAR_TEST_DEVICE (tests/util/ops_table.h: an error, not a skip, without one)
  SEQPAR_TEST_DEVICE=$device OMP_NUM_THREADS=2 "$t/test_gdn_composed" --gtest_brief=1 || exit 1
  SEQPAR_TEST_DEVICE=$device OMP_NUM_THREADS=2 "$t/test_dsa_composed" --gtest_brief=1 || exit 1
  # the existing GDN and DSA tests through the composition on that table (tests/util/ops_table_hooks.cc,
  # ops_table_dsa_hooks.cc); a route without a CUDA table skips the run with the reason: a failure here
  local g
  for g in test_gdn test_gdn_packed test_gdn_conv test_dsa test_dsa_packed_kernel; do
    SEQPAR_LOWERED_ATTENTION=1 SEQPAR_TEST_DEVICE=$device OMP_NUM_THREADS=2 "$t/$g" --gtest_brief=1 2>&1 |
      tee "$out/$g.composed.txt" || exit 1
    if grep -q "no CUDA ops table for the composed" "$out/$g.composed.txt"; then
      echo "gpu_check: $g skipped its composed run on $device"
      exit 1
    fi
  done
}

# The GDN and DSA CP tests at 2 and 4 ranks with every kernel call composed on the table of $device: the cases that
# compare the CP result with the one-rank result (the one-rank run is composed too).
cp_ops() {
  command -v mpirun >/dev/null || {
    echo "gpu_check: skipped: mpirun not found, and the composed CP tests need MPI (the one-process composed tests ran in phase ops)"
    exit 77
  }
  # each binary's cases that check the CP result against one rank or the fp64 reference (test: filter)
  local cases=("test_gdn_cp GdnCp/GdnCpVsRecurrence.*" "test_gdn_cp_packed GdnCpPacked.MatchesPackedReference*"
               "test_dsa_cp DsaCp/DsaCpVsSingleRank.*"
               "test_dsa_packed DsaPacked.MixedDocumentsMatchEachDocumentAlone:DsaPacked.OneDocumentEqualsTheUnpackedPath")
  local np c t filter log
  for np in 2 4; do
    for c in "${cases[@]}"; do
      t=${c%% *}
      filter=${c#* }
      log="$out/$t.composed.np$np.txt"
      echo "# mpirun -np $np $t --gtest_filter=$filter (SEQPAR_LOWERED_ATTENTION=1 SEQPAR_TEST_DEVICE=$device)"
      SEQPAR_LOWERED_ATTENTION=1 SEQPAR_TEST_DEVICE=$device OMP_NUM_THREADS=1 mpirun -np "$np" "$bin/tests/mpi/$t" \
        --gtest_filter="$filter" --gtest_brief=1 --gtest_color=no 2>&1 | tee "$log" || exit 1
      if grep -q "no CUDA ops table for the composed" "$log"; then
        echo "gpu_check: $t skipped its composed run on $device"
        exit 1
      fi
      if grep -q "^\[==========\] 0 tests from" "$log"; then
        echo "gpu_check: $t has no case matching $filter"
        exit 1
      fi
    done
  done
}

sanitize() {
  local t="$bin/tests/unit/test_device_attention"
  if [ "$dry_run" = 1 ]; then
    echo "# dry run: compute-sanitizer checks CUDA kernels only; the same *Tiny* cases run without it"
    SEQPAR_TEST_DEVICE=cpu "$t" --gtest_filter='*Tiny*' --gtest_brief=1 || exit 1
    SEQPAR_TEST_DEVICE=cpu "$bin/tests/unit/test_ops_table" --gtest_filter='*/cpu' --gtest_brief=1
    return
  fi
  command -v compute-sanitizer >/dev/null || { echo "gpu_check: compute-sanitizer not found (CUDA toolkit bin/)"; exit 1; }
  local tool
  for tool in memcheck racecheck; do
    echo "# compute-sanitizer --tool $tool"
    SEQPAR_TEST_DEVICE=cuda compute-sanitizer --tool "$tool" --error-exitcode 3 "$t" --gtest_filter='RowKernelsTiny*:*Tiny*' \
      --gtest_brief=1 || exit 1
  done
  echo "# compute-sanitizer --tool memcheck: the CUDA ops table"
  SEQPAR_TEST_DEVICE=cuda compute-sanitizer --tool memcheck --error-exitcode 3 "$bin/tests/unit/test_ops_table" \
    --gtest_filter='*/cuda' --gtest_brief=1 || exit 1
}

bench() {
  # shellcheck disable=SC2086
  "$bin/benchmarks/kernel_bench" $kb_args_s --json "$out/kernel_bench.json" || exit 1
  if python3 -c 'import torch' 2>/dev/null; then
    # shellcheck disable=SC2086
    python3 "$root/scripts/sdpa_bench.py" $sdpa_args_s --json "$out/sdpa_bench.json" || exit 1
  else
    echo "# PyTorch not importable: no SDPA comparison"
    [ "$dry_run" = 1 ] || exit 1
  fi
}

opsbench() {
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=2 "$bin/benchmarks/ops_bench" $ob_args_s --json "$out/ops_bench.json" || exit 1
  # shellcheck disable=SC2086
  python3 "$root/scripts/gdn_fla_bench.py" $fla_args_s --ops-json "$out/ops_bench.json" \
    --json "$out/gdn_fla_bench.json" || exit 1
}

cp_ranks() {
  command -v mpirun >/dev/null || { echo "gpu_check: mpirun not found: the CP phase needs MPI"; exit 1; }
  local np args
  for np in 2 4; do
    for args in "--ring-size $np --layout zigzag --causal" "--ulysses-size 2 --ring-size $((np / 2)) --layout zigzag --causal"; do
      echo "# mpirun -np $np sp_bench --device $device $args $sp_shape_s --check"
      # shellcheck disable=SC2086
      OMP_NUM_THREADS=1 mpirun -np "$np" "$bin/benchmarks/sp_bench" --device "$device" $args $sp_shape_s \
        --check --quiet --warmup 0 --iters 1 || exit 1
    done
  done
}

limit() {  # SEQPAR_GPU_CHECK_<PHASE>_S overrides the default; the dry run adds 60 s (importing PyTorch alone takes
  # tens of seconds on a loaded CPU machine, and the CPU does the device's work)
  local var="SEQPAR_GPU_CHECK_${1^^}_S"
  echo "${!var:-$(($2 + 60 * dry_run))}"
}

run_phase probe "$(limit probe 90)" probe
run_phase build "$(limit build 95)" build
run_phase kernels "$(limit kernels 20)" kernels
run_phase ops "$(limit ops 20)" ops
run_phase cpops "$(limit cpops 25)" cp_ops
run_phase sanitize "$(limit sanitize 20)" sanitize
run_phase bench "$(limit bench 20)" bench
run_phase opsbench "$(limit opsbench 60)" opsbench
run_phase cp "$(limit cp 10)" cp_ranks
summary
