#!/usr/bin/env python3
"""Scaling sweeps of sp_bench: runs it under mpirun over rank counts, grids and sequence lengths, in strong scaling
(fixed global sequence length) and weak scaling (fixed tokens per rank), and collects the JSON of every run into one
CSV (one row per run and phase). Progress goes to stderr.

Example (this machine has 2 cores: timings beyond 2 ranks are oversubscribed and not meaningful):
  scripts/sweep.py --build-dir build --ranks 1,2 --seqs 2K,4K,8K --grids ring,ulysses --causal \
      --weak-seq-per-rank 2K --out docs/sweep.csv
  /usr/bin/python3 scripts/plot.py docs/sweep.csv --out docs/scaling.png

Grids for P ranks: ring = 1 x P, ulysses = P x 1, usp = 2 x P/2 (P >= 4, even). P = 1 is one run, the baseline.
Efficiency in the CSV: `efficiency` is sp_bench's own (--efficiency: the whole problem on one rank, same run);
`sweep_efficiency` comes from this sweep's 1-rank runs: strong scaling T1(S) / (P x T_P(S)); weak scaling (the work
per rank of attention grows with P at fixed tokens per rank) the TFLOP/s per rank relative to the 1-rank run.
"""
import argparse
import csv
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

FIELDS = [
    "scaling", "ranks", "grid", "ulysses_size", "ring_size", "impl", "layout", "seq", "batch", "heads", "kv_heads",
    "head_dim", "causal", "dtype", "threads", "phase", "time_ms", "tflops_total", "tflops_per_rank",
    "exposed_comm_pct", "bytes_sent_per_rank", "mem_total_mib", "single_rank_ms", "efficiency", "single_rank_busy_ms", "efficiency_busy", "sweep_efficiency",
    "flops",
]


def parse_size(text):
    text = text.strip()
    mult = 1
    if text[-1:] in ("k", "K"):
        mult, text = 1024, text[:-1]
    elif text[-1:] in ("m", "M"):
        mult, text = 1024 * 1024, text[:-1]
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (expected e.g. 4096, 8K, 1M)")
    return int(text) * mult


def int_list(text):
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}")


def size_list(text):
    return [parse_size(x) for x in text.split(",") if x]


def grids_for(ranks, names):
    """(name, ulysses_size, ring_size) for each requested grid kind that fits `ranks`."""
    if ranks == 1:
        return [("1rank", 1, 1)]
    out = []
    for name in names:
        if name == "ring":
            out.append(("ring", 1, ranks))
        elif name == "ulysses":
            out.append(("ulysses", ranks, 1))
        elif name == "usp":
            if ranks >= 4 and ranks % 2 == 0:
                out.append(("usp", 2, ranks // 2))
        else:
            raise SystemExit(f"sweep.py: unknown grid {name!r} (expected ring, ulysses, usp)")
    return out


def child_env(threads):
    env = dict(os.environ)
    # OpenMPI refuses root and more ranks than cores unless told; the vader single-copy mechanism needs ptrace
    # permissions that containers often lack.
    env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
        "OMP_NUM_THREADS": str(threads),
    })
    return env


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--build-dir", default="build", help="build directory holding benchmarks/sp_bench")
    ap.add_argument("--sp-bench", help="path of sp_bench (default: BUILD_DIR/benchmarks/sp_bench)")
    ap.add_argument("--mpirun", default="mpirun", help="launcher (default mpirun)")
    ap.add_argument("--ranks", type=int_list, default=[1, 2], help="rank counts, e.g. 1,2,4")
    ap.add_argument("--seqs", type=size_list, default=[2048, 4096], help="strong scaling: global lengths (K/M ok)")
    ap.add_argument("--weak-seq-per-rank", type=parse_size, default=0,
                    help="weak scaling: tokens per rank (0: no weak scaling runs)")
    ap.add_argument("--grids", default="ring,ulysses,usp", help="grid kinds: ring, ulysses, usp")
    ap.add_argument("--impls", default="p2p", help="ring implementations: p2p, allgather")
    ap.add_argument("--layout", default="zigzag")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--threads", type=int, default=1, help="OpenMP threads per rank")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--efficiency", action="store_true", help="pass --efficiency to every multi-rank run")
    ap.add_argument("--extra", default="", help="more sp_bench flags, one string")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--out", default="sweep.csv", help="CSV file to write")
    ap.add_argument("--dry-run", action="store_true", help="print the command lines only")
    args = ap.parse_args()

    sp_bench = args.sp_bench or os.path.join(args.build_dir, "benchmarks", "sp_bench")
    if not args.dry_run and not os.access(sp_bench, os.X_OK):
        raise SystemExit(f"sweep.py: {sp_bench} is not an executable (build it, or pass --sp-bench)")
    grid_names = [g for g in args.grids.split(",") if g]
    impls = [i for i in args.impls.split(",") if i]

    # The run list: (scaling, ranks, grid, pu, pr, impl, seq)
    runs = []
    for seq in args.seqs:
        for p in args.ranks:
            for grid, pu, pr in grids_for(p, grid_names):
                for impl in (impls if pr > 1 else impls[:1]):
                    runs.append(("strong", p, grid, pu, pr, impl, seq))
    if args.weak_seq_per_rank > 0:
        for p in args.ranks:
            for grid, pu, pr in grids_for(p, grid_names):
                for impl in (impls if pr > 1 else impls[:1]):
                    runs.append(("weak", p, grid, pu, pr, impl, args.weak_seq_per_rank * p))

    rows = []
    env = child_env(args.threads)
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="seqpar_sweep_") as tmp:
        for n, (scaling, p, grid, pu, pr, impl, seq) in enumerate(runs, 1):
            json_path = os.path.join(tmp, f"run{n}.json")
            cmd = [args.mpirun, "-np", str(p), sp_bench, "--ulysses-size", str(pu), "--ring-size", str(pr),
                   "--impl", impl, "--layout", args.layout, "--seq", str(seq), "--batch", str(args.batch),
                   "--heads", str(args.heads), "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim),
                   "--dtype", args.dtype, "--threads", str(args.threads), "--warmup", str(args.warmup),
                   "--iters", str(args.iters), "--json", json_path, "--quiet"]
            if args.causal:
                cmd.append("--causal")
            if args.efficiency and p > 1:
                cmd.append("--efficiency")
            cmd += shlex.split(args.extra)
            line = " ".join(shlex.quote(c) for c in cmd)
            print(f"[sweep {n}/{len(runs)} {time.time() - start:7.1f} s] {scaling} {grid} "
                  f"{pu}x{pr} {impl} S={seq}: {line}", file=sys.stderr, flush=True)
            if args.dry_run:
                continue
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                print(f"[sweep] run {n} timed out after {args.timeout} s; skipped", file=sys.stderr)
                continue
            if proc.returncode != 0 or not os.path.exists(json_path):
                print(f"[sweep] run {n} failed (exit {proc.returncode}); skipped:\n{proc.stdout[-2000:]}"
                      f"{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            with open(json_path) as f:
                result = json.load(f)
            shape = result["shape"]
            for ph in result["phases"]:
                rows.append({
                    "scaling": scaling, "ranks": p, "grid": grid, "ulysses_size": pu, "ring_size": pr,
                    "impl": impl if pr > 1 else "-", "layout": result["layout"], "seq": shape["seq"],
                    "batch": shape["batch"], "heads": shape["heads"], "kv_heads": shape["kv_heads"],
                    "head_dim": shape["head_dim"], "causal": int(shape["causal"]), "dtype": result["dtype"],
                    "threads": result["threads_per_rank"], "phase": ph["phase"], "time_ms": ph["time_ms"],
                    "tflops_total": ph["tflops_total"], "tflops_per_rank": ph["tflops_per_rank"],
                    "exposed_comm_pct": ph["exposed_comm_pct"], "bytes_sent_per_rank": ph["bytes_sent_per_rank"],
                    "mem_total_mib": ph["mem_peak_mib"]["total"], "single_rank_ms": ph.get("single_rank_ms", ""),
                    "efficiency": ph.get("efficiency", ""), "single_rank_busy_ms": ph.get("single_rank_busy_ms", ""),
                    "efficiency_busy": ph.get("efficiency_busy", ""), "sweep_efficiency": "", "flops": ph["flops"],
                })
            fb = [ph for ph in result["phases"] if ph["phase"] == "fwd+bwd"][0]
            print(f"[sweep {n}/{len(runs)}] fwd+bwd {fb['time_ms']:.1f} ms, {fb['tflops_total']:.4f} TFLOP/s total",
                  file=sys.stderr, flush=True)

    # Efficiency from this sweep's 1-rank runs: strong scaling T1(S) / (P T_P(S)); weak scaling (work per rank
    # grows with S for attention) as throughput per rank relative to one rank: (F_P / (P T_P)) / (F_1 / T_1).
    base = {}
    for r in rows:
        if r["ranks"] == 1:
            base[(r["scaling"], r["seq"], r["phase"])] = r
    weak_base = {(r["phase"]): r for r in rows if r["ranks"] == 1 and r["scaling"] == "weak"}
    for r in rows:
        if r["scaling"] == "strong":
            b = base.get(("strong", r["seq"], r["phase"]))
            if b:
                r["sweep_efficiency"] = b["time_ms"] / (r["ranks"] * r["time_ms"])
        else:
            b = weak_base.get(r["phase"])
            if b:
                r["sweep_efficiency"] = r["tflops_per_rank"] / b["tflops_per_rank"]

    if not args.dry_run:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        # Like sp_bench's files: a temporary name in the same directory, renamed when complete.
        tmp_out = f"{args.out}.tmp.{os.getpid()}"
        try:
            with open(tmp_out, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=FIELDS)
                w.writeheader()
                w.writerows(rows)
            os.replace(tmp_out, args.out)
        except OSError as e:
            if os.path.exists(tmp_out):
                os.remove(tmp_out)
            raise SystemExit(f"sweep.py: cannot write {args.out}: {e}")
        print(f"[sweep] {len(rows)} rows from {len(runs)} runs -> {args.out} ({time.time() - start:.1f} s)",
              file=sys.stderr)


if __name__ == "__main__":
    main()
