#!/usr/bin/env python3
"""Scaling sweeps of sp_bench for one attention kind (mha, gdn, dsa): runs it under mpirun over rank counts,
algorithms and sequence lengths, in strong scaling (fixed global sequence length) and weak scaling (fixed tokens per
rank), and collects the JSON of every run into one CSV (one row per run and phase; --append adds to an existing CSV,
so that one file holds every kind). Progress goes to stderr.

  scripts/sweep.py --attn mha --ranks 1,2 --seqs 2K,4K --causal --out docs/sweep.csv
  scripts/sweep.py --attn gdn --ranks 1,2 --seqs 2K,4K --append --out docs/sweep.csv
  scripts/plot.py docs/sweep.csv --attn gdn --out docs/scaling_gdn.png
  (scripts/make_figures.sh makes the figures of docs/ this way.)

Algorithms (--algos, default: every one of the kind that fits): each names its grid for P ranks and its flags.
  mha: p2p (ring 1 x P, --impl p2p), allgather (ring 1 x P, --impl allgather), ulysses (P x 1), usp (2 x P/2, P >= 4)
  gdn: chain, scan (ring 1 x P, --gdn-mode), ulysses (P x 1)
  dsa: ring, allgather (ring 1 x P, --dsa-select), ulysses (P x 1)
P = 1 is one run per sequence length, algorithm "1rank": the baseline of every algorithm.
Modes (--mode): train (forward and backward). A mode is one row of MODES (its sp_bench flags and phases); packed and
decode runs will be rows there once sp_bench has them.
Efficiency in the CSV: `efficiency` is sp_bench's own (--efficiency: the whole problem on one rank, same run);
`sweep_efficiency` comes from this sweep's 1-rank runs: strong scaling T1(S) / (P x T_P(S)); weak scaling the TFLOP/s
per rank relative to the 1-rank run (the work per rank of attention grows with P at fixed tokens per rank).
Timing spread: time_min_ms / time_max_ms and the quartiles time_q1_ms / time_q3_ms over the timed iterations (each
the slowest rank's time), from sp_bench's time_iters_ms.
"""
import argparse
import csv
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

# ---- what differs between kinds: one entry each ----------------------------------------------------------------
RING = lambda p: (1, p)  # noqa: E731  (ulysses_size, ring_size) for P ranks
ULYSSES = lambda p: (p, 1)  # noqa: E731
USP = lambda p: (2, p // 2) if p >= 4 and p % 2 == 0 else None  # noqa: E731


def mha_shape(j):
    s = j["shape"]
    text = f"B={s['batch']} Hq={s['heads']} Hkv={s['kv_heads']} D={s['head_dim']} {'causal' if s['causal'] else 'full'}"
    return text + (f" window={s['window']}" if s.get("window") else "")


def gdn_shape(j):
    s = j["shape"]
    return (f"B={s['batch']} Hv={s['heads']} Hk={s['kv_heads']} K={s['head_dim']} V={s['dim_v']} "
            f"conv={s['conv_width']} chunk={s['chunk_size']} (causal recurrence)")


def dsa_shape(j):
    s = j["shape"]
    return (f"B={s['batch']} H={s['heads']} Dqk={s['head_dim']} Dv={s['dim_v']} topk={s['topk']} "
            f"indexer Hi={s['indexer_heads']} Di={s['indexer_dim']} (causal)")


def kv_heads_flag(a):
    """--kv-heads when given (sp_bench's default: as many as --heads)."""
    return ["--kv-heads", str(a.kv_heads)] if a.kv_heads else []


def mode_kind(flag, modes, shape, flags=lambda a: []):
    """A kind whose ring algorithms are the values of one flag (default: those), plus Ulysses over heads."""
    algos = {m: (RING, [flag, m]) for m in modes}
    algos["ulysses"] = (ULYSSES, [])
    return {"algos": algos, "default_algos": ",".join(modes), "shape": shape, "flags": flags}


KINDS = {
    "mha": {
        "algos": {"p2p": (RING, ["--impl", "p2p"]), "allgather": (RING, ["--impl", "allgather"]),
                  "ulysses": (ULYSSES, []), "usp": (USP, ["--impl", "p2p"])},
        "shape": mha_shape,
        "flags": lambda a: kv_heads_flag(a) + (["--causal"] if a.causal else []),
    },
    "gdn": mode_kind("--gdn-mode", ["chain", "scan"], gdn_shape, kv_heads_flag),
    "dsa": mode_kind("--dsa-select", ["ring", "allgather"], dsa_shape),
}

# ---- modes: sp_bench flags and the phases they report (a future mode is one more row) ---------------------------
MODES = {
    "train": {"flags": [], "phases": ["fwd", "bwd", "fwd+bwd"]},
    # "packed": {"flags": ["--cu-seqlens", ...], "phases": [...]},   once sp_bench runs packed sequences
    # "decode": {"flags": ["--decode", ...], "phases": ["decode"]},  once sp_bench runs decode steps
}

MEM_CATEGORIES = ["model_state", "saved_activation", "persistent_cache", "workspace", "comm_buffer"]
FIELDS = (["attn", "mode", "scaling", "ranks", "algo", "grid", "ulysses_size", "ring_size", "shape", "seq", "batch",
           "layout", "dtype", "threads", "phase", "time_ms", "time_min_ms", "time_q1_ms", "time_q3_ms", "time_max_ms",
           "iters", "tflops_total", "tflops_per_rank", "exposed_comm_pct", "bytes_sent_per_rank"] +
          [f"mem_{c}_mib" for c in MEM_CATEGORIES] +
          ["mem_total_mib", "mem_estimate_mib", "single_rank_ms", "efficiency", "efficiency_busy", "sweep_efficiency",
           "flops", "oversubscribed", "host", "git_commit", "date_utc"])


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


def runs_for(kind, algos, ranks):
    """(algo, ulysses_size, ring_size, flags) of every algorithm that fits `ranks`; one '1rank' run for P = 1."""
    if ranks == 1:
        return [("1rank", 1, 1, [])]
    out = []
    for name in algos:
        grid, flags = KINDS[kind]["algos"][name]
        pu_pr = grid(ranks)
        if pu_pr is not None:
            out.append((name, pu_pr[0], pu_pr[1], flags))
    return out


def child_env(threads, build_dir, probe):
    env = dict(os.environ)
    # OpenMPI refuses root and more ranks than cores unless told.
    env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        "OMP_NUM_THREADS": str(threads),
    })
    # Large local messages by cross-memory attach where the machine allows it, else through shared memory (containers
    # without the ptrace permission): the same probe as scripts/common.sh.
    if probe:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_single_copy.sh")
        probe = subprocess.run([script, build_dir], env=env, capture_output=True, text=True)
        mech = probe.stdout.strip() if probe.returncode == 0 else "none"  # cannot probe: what works everywhere
        if mech == "none" and "OMPI_MCA_btl_vader_single_copy_mechanism" not in os.environ:
            print("sweep.py: cross-memory attach is refused here; OpenMPI copies large messages through shared "
                  "memory (OMPI_MCA_btl_vader_single_copy_mechanism=none)", file=sys.stderr)
            env["OMPI_MCA_btl_vader_single_copy_mechanism"] = "none"
    return env


def quartiles(xs):
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def rows_of(result, attn, mode, scaling, ranks, algo, pu, pr, shape_fn):
    rows = []
    est = result.get("memory_estimate", {}).get("ledger_peak_bytes", "")
    phases = MODES[mode]["phases"]
    for ph in result["phases"]:
        if ph["phase"] not in phases:
            continue
        iters = ph.get("time_iters_ms") or [ph["time_ms"]]
        q1, q3 = quartiles(iters)
        mem = ph["mem_peak_mib"]
        row = {
            "attn": attn, "mode": mode, "scaling": scaling, "ranks": ranks, "algo": algo,
            "grid": f"{pu}x{pr}", "ulysses_size": pu, "ring_size": pr, "shape": shape_fn(result),
            "seq": result["shape"]["seq"], "batch": result["shape"]["batch"], "layout": result["layout"],
            "dtype": result["dtype"], "threads": result["threads_per_rank"], "phase": ph["phase"],
            "time_ms": ph["time_ms"], "time_min_ms": ph.get("time_min_ms", ph["time_ms"]), "time_q1_ms": q1,
            "time_q3_ms": q3, "time_max_ms": ph.get("time_max_ms", ph["time_ms"]), "iters": len(iters),
            "tflops_total": ph["tflops_total"], "tflops_per_rank": ph["tflops_per_rank"],
            "exposed_comm_pct": ph["exposed_comm_pct"], "bytes_sent_per_rank": ph["bytes_sent_per_rank"],
            "mem_total_mib": mem["total"], "mem_estimate_mib": est / 2**20 if est != "" else "",
            "single_rank_ms": ph.get("single_rank_ms", ""), "efficiency": ph.get("efficiency", ""),
            "efficiency_busy": ph.get("efficiency_busy", ""), "sweep_efficiency": "", "flops": ph["flops"],
            "oversubscribed": int(result.get("ranks_per_node", 1) * result["threads_per_rank"] >
                                  result.get("cores_per_node", 1 << 30)),
            "host": result.get("host", ""), "git_commit": result.get("git_commit", ""),
            "date_utc": result.get("date_utc", ""),
        }
        for c in MEM_CATEGORIES:
            row[f"mem_{c}_mib"] = mem.get(c, 0.0)
        rows.append(row)
    return rows


def add_sweep_efficiency(rows):
    """Strong scaling T1(S) / (P T_P(S)); weak scaling (F_P / (P T_P)) / (F_1 / T_1), from the 1-rank rows."""
    def key(r):
        return (r["attn"], r["mode"], r["shape"], r["dtype"], r["threads"], r["phase"])
    base = {(key(r), r["seq"]): r for r in rows if int(r["ranks"]) == 1 and r["scaling"] == "strong"}
    weak_base = {key(r): r for r in rows if int(r["ranks"]) == 1 and r["scaling"] == "weak"}
    for r in rows:
        ranks, t = int(r["ranks"]), float(r["time_ms"])
        if r["scaling"] == "strong":
            b = base.get((key(r), r["seq"]))
            if b:
                r["sweep_efficiency"] = float(b["time_ms"]) / (ranks * t)
        else:
            b = weak_base.get(key(r))
            if b:
                r["sweep_efficiency"] = float(r["tflops_per_rank"]) / float(b["tflops_per_rank"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--attn", default="mha", choices=sorted(KINDS), help="attention kind")
    ap.add_argument("--mode", default="train", choices=sorted(MODES), help="what is timed (MODES)")
    ap.add_argument("--algos", help="comma list of the kind's algorithms (default: see above)")
    ap.add_argument("--build-dir", default="build", help="build directory holding benchmarks/sp_bench")
    ap.add_argument("--sp-bench", help="path of sp_bench (default: BUILD_DIR/benchmarks/sp_bench)")
    ap.add_argument("--mpirun", default="mpirun", help="launcher (default mpirun)")
    ap.add_argument("--ranks", type=int_list, default=[1, 2], help="rank counts, e.g. 1,2,4")
    ap.add_argument("--seqs", type=size_list, default=[2048, 4096], help="strong scaling: global lengths (K/M ok)")
    ap.add_argument("--weak-seq-per-rank", type=parse_size, default=0,
                    help="weak scaling: tokens per rank (0: no weak scaling runs)")
    ap.add_argument("--layout", default="zigzag")
    ap.add_argument("--causal", action="store_true", help="mha: causal mask (gdn and dsa are causal anyway)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8, help="mha: query heads; gdn: value heads")
    ap.add_argument("--kv-heads", type=int, default=0,
                    help="mha: kv heads; gdn: key heads (default 0: as many as --heads, as sp_bench)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--threads", type=int, default=1, help="OpenMP threads per rank")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--efficiency", action="store_true", help="pass --efficiency to every multi-rank run")
    ap.add_argument("--extra", default="", help="more sp_bench flags, one string (e.g. the kind's own flags)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--out", default="sweep.csv", help="CSV file to write")
    ap.add_argument("--append", action="store_true", help="keep the rows already in --out (other kinds, modes)")
    ap.add_argument("--dry-run", action="store_true", help="print the command lines only")
    args = ap.parse_args()

    kind = KINDS[args.attn]
    algos = [a for a in (args.algos or kind.get("default_algos", ",".join(kind["algos"]))).split(",") if a]
    for a in algos:
        if a not in kind["algos"]:
            raise SystemExit(f"sweep.py: --attn {args.attn} has no algorithm {a!r} (expected one of "
                             f"{', '.join(kind['algos'])})")
    sp_bench = args.sp_bench or os.path.join(args.build_dir, "benchmarks", "sp_bench")
    if not args.dry_run and not os.access(sp_bench, os.X_OK):
        raise SystemExit(f"sweep.py: {sp_bench} is not an executable (build it, or pass --sp-bench)")

    runs = []  # (scaling, ranks, algo, pu, pr, flags, seq)
    for seq in args.seqs:
        for p in args.ranks:
            runs += [("strong", p, *r, seq) for r in runs_for(args.attn, algos, p)]
    if args.weak_seq_per_rank > 0:
        for p in args.ranks:
            runs += [("weak", p, *r, args.weak_seq_per_rank * p) for r in runs_for(args.attn, algos, p)]

    old_rows = []
    if args.append and os.path.exists(args.out):
        with open(args.out, newline="") as f:
            old_rows = [r for r in csv.DictReader(f) if r["attn"] != args.attn or r["mode"] != args.mode]
    rows, failed = [], 0
    env = child_env(args.threads, os.path.dirname(os.path.dirname(os.path.abspath(sp_bench))), not args.dry_run)
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="seqpar_sweep_") as tmp:
        for n, (scaling, p, algo, pu, pr, flags, seq) in enumerate(runs, 1):
            json_path = os.path.join(tmp, f"run{n}.json")
            cmd = [args.mpirun, "-np", str(p), sp_bench, "--attn", args.attn, "--ulysses-size", str(pu),
                   "--ring-size", str(pr), "--layout", args.layout, "--seq", str(seq), "--batch", str(args.batch),
                   "--heads", str(args.heads), "--head-dim", str(args.head_dim), "--dtype", args.dtype,
                   "--threads", str(args.threads), "--warmup", str(args.warmup), "--iters", str(args.iters),
                   "--json", json_path, "--quiet"] + flags + kind["flags"](args) + MODES[args.mode]["flags"]
            if args.efficiency and p > 1:
                cmd.append("--efficiency")
            cmd += shlex.split(args.extra)
            line = " ".join(shlex.quote(c) for c in cmd)
            print(f"[sweep {n}/{len(runs)} {time.time() - start:7.1f} s] {args.attn} {scaling} {algo} {pu}x{pr} "
                  f"S={seq}: {line}", file=sys.stderr, flush=True)
            if args.dry_run:
                continue
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                print(f"[sweep] run {n} timed out after {args.timeout} s; skipped", file=sys.stderr)
                failed += 1
                continue
            if proc.returncode != 0 or not os.path.exists(json_path):
                print(f"[sweep] run {n} failed (exit {proc.returncode}); skipped:\n{proc.stdout[-2000:]}"
                      f"{proc.stderr[-2000:]}", file=sys.stderr)
                failed += 1
                continue
            with open(json_path) as f:
                result = json.load(f)
            new = rows_of(result, args.attn, args.mode, scaling, p, algo, pu, pr, kind["shape"])
            rows += new
            fb = [r for r in new if r["phase"] == "fwd+bwd"]
            if fb:
                print(f"[sweep {n}/{len(runs)}] fwd+bwd {fb[0]['time_ms']:.2f} ms "
                      f"[{fb[0]['time_min_ms']:.2f}, {fb[0]['time_max_ms']:.2f}], "
                      f"{fb[0]['tflops_total']:.4f} TFLOP/s total", file=sys.stderr, flush=True)

    add_sweep_efficiency(rows)
    if args.dry_run:
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    # Like sp_bench's files: a temporary name in the same directory, renamed when complete.
    tmp_out = f"{args.out}.tmp.{os.getpid()}"
    try:
        with open(tmp_out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
            w.writeheader()
            w.writerows(old_rows + rows)
        os.replace(tmp_out, args.out)
    except OSError as e:
        if os.path.exists(tmp_out):
            os.remove(tmp_out)
        raise SystemExit(f"sweep.py: cannot write {args.out}: {e}")
    print(f"[sweep] {len(rows)} rows from {len(runs)} runs -> {args.out} ({len(old_rows)} kept; "
          f"{time.time() - start:.1f} s)", file=sys.stderr)
    if failed:
        raise SystemExit(f"sweep.py: {failed} of {len(runs)} runs failed (see above); the CSV holds the others")


if __name__ == "__main__":
    main()
