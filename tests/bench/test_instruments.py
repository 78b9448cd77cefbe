#!/usr/bin/env python3
"""Checks of the benchmarks as measuring instruments (ctest, tests/mpi/CMakeLists.txt): each subcommand runs the
programs under mpirun on small shapes and checks what they write against what it must be. No wall-clock asserts.

  test_instruments.py --mpiexec mpirun --bin-dir build/benchmarks json
  ... memory --np 2 -- --attn gdn --ring-size 2 ...   (the estimate against the ledger's measured peak)
  ... roundtrip --np 2 -- --attn dsa --ring-size 2 ... (--dump --dump-inputs, then --inputs of that dump)
  ... decode-grids --np 4 -- --mode decode ...        (a grid's decode --dump against one rank's on its inputs)
  ... decode-replay --np 2 -- --mode decode --attn dsa ... (what decode --inputs asks for and names; its JSON)
  ... comm                                            (comm_bench table and JSON)
  ... sweep --scripts scripts                         (sweep.py + plot.py on a small sweep of every kind)
  ... kernel                                          (kernel_bench --kernel all: tables, JSON, FLOP counts)
  ... ops                                             (ops_bench --table cpu: GDN fwd/bwd rows, DSA byte/FLOP floors)
Prints "passed" at the end; any failed check raises with what was expected and what was found.
"""
import argparse
import csv
import datetime
import filecmp
import json
import glob
import os
import re
import resource
import statistics
import signal
import subprocess
import sys
import tempfile

ARGS = None


def run(np, program, args, expect_rc=0):
    cmd = [ARGS.mpiexec, ARGS.np_flag, str(np), os.path.join(ARGS.bin_dir, program)] + [str(a) for a in args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    if expect_rc == 0 and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}: exit {proc.returncode}, expected 0\n{out}")
    if expect_rc != 0 and proc.returncode == 0:
        raise AssertionError(f"{' '.join(cmd)}: exit 0, expected a failure\n{out}")
    return out


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def check_json_write_is_atomic(cmd, path):
    """`cmd` (a benchmark of one process) writing --json `path`, where `path` holds that command's JSON already: cut
    off mid-write by a file-size limit below the JSON's size, it must leave `path` as it was, whether the limit kills
    it (SIGXFSZ, as a crash would) or fails the write (SIGXFSZ ignored: EFBIG, a non-zero exit naming the path and no
    temporary file left). A write straight into `path` left half a file."""
    old = open(path, "rb").read()
    limit = len(old) // 2

    def small_files(ignore_signal):
        def apply():
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
            if ignore_signal:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        return apply

    for ignore_signal in (False, True):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, preexec_fn=small_files(ignore_signal))
        how = "EFBIG" if ignore_signal else "SIGXFSZ"
        what = f"{os.path.basename(cmd[0])} --json under a {limit}-byte file limit ({how})"
        check(p.returncode != 0, f"{what}: exit 0\n{p.stdout}{p.stderr}")
        check(open(path, "rb").read() == old, f"{what}: {path} changed (a partial file)")
        leftovers = glob.glob(glob.escape(path) + ".tmp.*")
        if ignore_signal:
            check(path in p.stderr and not leftovers, f"{what}: error {p.stderr!r}, temporary files {leftovers}")
        for f in leftovers:  # a killed process leaves its temporary file; `path` is intact
            os.remove(f)


def test_json(tmp):
    """sp_bench --json: per-phase spread and every iteration, the run's metadata."""
    path = os.path.join(tmp, "run.json")
    threads = os.cpu_count() or 1  # 2 ranks x all the cores: always oversubscribed, so the warning must show
    out = run(2, "sp_bench", ["--ring-size", 2, "--seq", 256, "--heads", 2, "--kv-heads", 2, "--head-dim", 16,
                              "--warmup", 0, "--iters", 4, "--threads", threads, "--quiet", "--json", path])
    check(f"# warning: ranks per node 2 x threads per rank {threads} = {2 * threads} exceeds the" in out,
          f"no oversubscription warning in the table header:\n{out}")
    check(out.count("sp_bench: warning: ranks per node 2") == 1, f"the warning must be printed once (rank 0):\n{out}")
    j = json.load(open(path))
    for key in ("version", "git_commit", "host", "date_utc", "ranks_per_node", "cores_per_node", "world_size",
                "threads_per_rank", "grid", "memory_estimate"):
        check(key in j, f"JSON has no '{key}'")
    check(j["world_size"] == 2 and j["ranks_per_node"] == 2, f"world_size / ranks_per_node: {j['world_size']}, "
          f"{j['ranks_per_node']} (expected 2, 2)")
    check(j["cores_per_node"] == os.cpu_count(), f"cores_per_node {j['cores_per_node']} != {os.cpu_count()}")
    check(j["threads_per_rank"] == threads, f"threads_per_rank {j['threads_per_rank']} != {threads}")
    check(re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?|unknown", j["git_commit"]) is not None,
          f"git_commit {j['git_commit']!r}")
    # The commit is the source tree's HEAD (taken at every build, not at configure time: a commit made after
    # configuring used to leave the old one in every header and JSON). Outside a git checkout: "unknown".
    try:
        head = subprocess.run(["git", "-C", os.path.join(ARGS.scripts, ".."), "rev-parse", "HEAD"],
                              capture_output=True, text=True)
    except FileNotFoundError:  # no git on this machine: the build wrote "unknown" too
        head = None
    if head is not None and head.returncode == 0:
        check(head.stdout.strip().startswith(j["git_commit"].removesuffix("-dirty")),
              f"git_commit {j['git_commit']!r} is not the source tree's HEAD {head.stdout.strip()} (rebuild?)")
    date = datetime.datetime.strptime(j["date_utc"], "%Y-%m-%dT%H:%M:%SZ")
    check(abs((datetime.datetime.utcnow() - date).total_seconds()) < 3600, f"date_utc {j['date_utc']} is not now")
    check(j["grid"]["ring_size"] == 2 and j["grid"]["ulysses_size"] == 1, f"grid {j['grid']}")
    for p in j["phases"]:
        it = p["time_iters_ms"]
        check(len(it) == 4, f"{p['phase']}: {len(it)} iterations, expected 4")
        check(p["time_min_ms"] == min(it) and p["time_max_ms"] == max(it), f"{p['phase']}: min/max {p}")
        check(abs(p["time_median_ms"] - statistics.median(it)) <= 1e-12 * max(it), f"{p['phase']}: median {p}")
        check(p["time_ms"] == p["time_median_ms"], f"{p['phase']}: time_ms is the median")
    fwd, bwd, both = j["phases"]
    for i in range(4):  # fwd+bwd of iteration i is the sum of its phases
        check(abs(both["time_iters_ms"][i] - fwd["time_iters_ms"][i] - bwd["time_iters_ms"][i]) < 1e-9,
              f"fwd+bwd iteration {i}")


def test_memory(tmp, np, flags):
    """The estimate of the ledger's peak against the peak the ledger measured (max over phases and ranks); in --mode
    train also each phase's estimate against that phase's measured peak."""
    path = os.path.join(tmp, "mem.json")
    run(np, "sp_bench", ["--quiet", "--warmup", 0, "--iters", 1, "--json", path] + flags)
    j = json.load(open(path))
    # --mode train: the largest phase's peak; --mode decode: the run's (prefill to the last step), the largest rank's
    peaks = [p["mem_peak_mib"] for p in j["phases"]] if "phases" in j else [j["mem_peak_mib"]]
    measured = max(p["total"] for p in peaks) * 2**20
    est = j["memory_estimate"]["ledger_peak_bytes"]
    # (name, estimate, measured): the largest peak, then in --mode train each phase against its own estimate
    pairs = [("peak", est, measured)]
    per_phase = j["memory_estimate"].get("phase_peak_bytes", {})
    check(("phases" in j) == bool(per_phase), "--mode train (only) must estimate each phase")
    check(not per_phase or abs(max(per_phase.values()) - est) <= 1e-6 * est,
          "the ledger peak must be the largest phase's estimate")
    for p in j.get("phases", []):
        if p["phase"] in per_phase:
            pairs.append((p["phase"], per_phase[p["phase"]], p["mem_peak_mib"]["total"] * 2**20))
    check(len(pairs) == 1 + len(per_phase), f"a phase estimate without its measured phase: {sorted(per_phase)}")
    for name, e, m in pairs:
        ratio = e / m
        print(f"{name}: memory estimate {e / 2**20:.2f} MiB, measured {m / 2**20:.2f} MiB: ratio {ratio:.3f}")
        # The rule (docs/benchmarks.md, "Memory estimate"): never below the measured peak, at most 1.5 x it. A phase below the
        # peak (the forward, which decode's prefill estimate reuses) must not be below its own measured peak either.
        top = 1.5 if name == "peak" or e >= est else float("inf")
        check(1.0 <= ratio <= top, f"{name}: estimate / measured = {ratio:.3f} is outside [1, {top}] for {flags}")
    cats = j["memory_estimate"]["ledger"]
    check(abs(sum(cats.values()) - est) <= 1e-6 * est, "the categories must add up to the ledger peak")
    dry = run(np, "sp_bench", ["--dry-run"] + flags)
    check("# memory estimate per rank" in dry and "ledger peak" in dry and ": fits" in dry,
          f"--dry-run must print the estimate and that it fits:\n{dry}")


def read_npy_dir(d):
    return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d)) if f.endswith(".npy")}


def test_roundtrip(tmp, np, flags):
    """--dump DIR --dump-inputs, then --inputs DIR: the same outputs, bit for bit, and the same inputs dumped again.
    The replay leaves out --conv-width (GDN takes it from conv_weight.npy) and --doc-lens / --doc-dist (a packed row
    is read from cu_seqlens.npy)."""
    a, b = os.path.join(tmp, "a"), os.path.join(tmp, "b")
    base = ["--quiet", "--warmup", 0, "--iters", 1]
    out = run(np, "sp_bench", base + flags + ["--dump", a, "--dump-inputs"])
    check("# dumped " in out, f"no dump line:\n{out}")
    dropped = ("--conv-width", "--doc-lens", "--doc-dist")
    replay = [f for i, f in enumerate(flags) if f not in dropped and (i == 0 or flags[i - 1] not in dropped)]
    run(np, "sp_bench", base + replay + ["--inputs", a, "--dump", b, "--dump-inputs"])
    fa, fb = read_npy_dir(a), read_npy_dir(b)
    check(sorted(fa) == sorted(fb), f"different files: {sorted(fa)} vs {sorted(fb)}")
    check(len(fa) >= 8, f"expected inputs and outputs, found {sorted(fa)}")
    for name in fa:
        check(fa[name] == fb[name], f"{name}: the run from the dumped inputs differs from the run that dumped them")


def read_npy_floats(path):
    """The elements of a little-endian fp32 / fp64 C-order .npy file (version 1.0, as sp_bench writes them)."""
    import ast
    import struct
    data = open(path, "rb").read()
    check(data[:6] == b"\x93NUMPY" and data[6] == 1, f"{path}: not a version 1.0 .npy file")
    (hlen,) = struct.unpack("<H", data[8:10])
    header = ast.literal_eval(data[10:10 + hlen].decode("latin1"))
    check(header["descr"] in ("<f4", "<f8") and not header["fortran_order"], f"{path}: header {header}")
    size = 4 if header["descr"] == "<f4" else 8
    body = data[10 + hlen:]
    return struct.unpack(f"<{len(body) // size}{'f' if size == 4 else 'd'}", body)


def test_decode_grids(tmp, np, flags):
    """sp_bench --mode decode --dump on a grid against the same inputs on one rank: every rank's heads land in their
    place in the gathered outputs (each output equal to the one-rank run's to fp32 rounding)."""
    a, b = os.path.join(tmp, "a"), os.path.join(tmp, "b")
    base = ["--quiet", "--warmup", 0, "--iters", 1]
    run(np, "sp_bench", base + flags + ["--dump", a, "--dump-inputs"])
    grid = ("--ring-size", "--ulysses-size", "--placement", "--conv-width")
    one = [f for i, f in enumerate(flags) if f not in grid and (i == 0 or flags[i - 1] not in grid)]
    run(1, "sp_bench", base + one + ["--inputs", a, "--dump", b])
    outputs = sorted(f for f in os.listdir(b) if f.endswith(".npy"))
    check(outputs and all(o in os.listdir(a) for o in outputs), f"outputs {outputs} vs {sorted(os.listdir(a))}")
    for name in outputs:
        x, y = read_npy_floats(os.path.join(a, name)), read_npy_floats(os.path.join(b, name))
        check(len(x) == len(y), f"{name}: {len(x)} vs {len(y)} elements")
        err = max(abs(p - q) for p, q in zip(x, y))
        ref = max(abs(q) for q in y)
        check(err <= 1e-5 * ref + 1e-6, f"{name}: the {np}-rank run differs from the one-rank run by {err} (max {ref})")


def without(flags, names):
    """flags less each of `names` and the value after it."""
    return [f for i, f in enumerate(flags) if f not in names and (i == 0 or flags[i - 1] not in names)]


def empty_npy(path, dim):
    """Rewrites the .npy file `path` (version 1.0) as an empty array: its shape with dimension `dim` 0, its dtype kept.
    Returns the new shape."""
    import ast
    import struct
    data = open(path, "rb").read()
    (hlen,) = struct.unpack("<H", data[8:10])
    header = ast.literal_eval(data[10:10 + hlen].decode("latin1"))
    shape = list(header["shape"])
    shape[dim] = 0
    text = "{'descr': %r, 'fortran_order': False, 'shape': %r, }" % (header["descr"], tuple(shape))
    text += " " * ((64 - (10 + len(text) + 1) % 64) % 64) + "\n"
    open(path, "wb").write(data[:8] + struct.pack("<H", len(text)) + text.encode("latin1"))
    return shape


def test_decode_replay(tmp, np, flags):
    """sp_bench --mode decode --attn dsa (flags with --dim-v, --new-tokens n, --decode-steps N) --dump, then --inputs
    of the dump: without --dim-v (which no input file carries) it stops and names the dump's Dv; a --new-tokens that
    does not divide the steps' tokens and a steps' file of 0 tokens are named as such; with --dim-v it runs, and its
    JSON's check holds lse_rel_err but no final_state_rel_err."""
    a = os.path.join(tmp, "a")
    base = ["--quiet", "--warmup", 0, "--iters", 1]
    run(np, "sp_bench", base + flags + ["--dump", a, "--dump-inputs"])
    value = lambda flag: int(flags[flags.index(flag) + 1])
    dv, n, steps = value("--dim-v"), value("--new-tokens"), value("--decode-steps")
    replay = without(flags, ("--dim-v", "--new-tokens", "--decode-steps")) + ["--inputs", a]
    out = run(np, "sp_bench", base + replay + ["--new-tokens", n], expect_rc=1)
    check("give --dim-v" in out and f"out_dec.npy of the dump has Dv = {dv}" in out, f"no --dim-v error:\n{out}")
    bad = n * steps + 1
    out = run(np, "sp_bench", base + replay + ["--dim-v", dv, "--new-tokens", bad], expect_rc=1)
    check(f"q_dec.npy holds {n * steps} decode tokens, not a multiple of --new-tokens {bad}" in out,
          f"no multiple-of error:\n{out}")
    path = os.path.join(tmp, "run.json")
    run(np, "sp_bench", base + replay + ["--dim-v", dv, "--new-tokens", n, "--check", "--json", path])
    j = json.load(open(path))
    check("lse_rel_err" in j["check"] and "final_state_rel_err" not in j["check"], f"check keys {j['check']}")
    check(j["dsa"]["dim_v"] == dv and j["decode_steps"] == steps, f"dim_v / decode_steps in {j}")
    shape = empty_npy(os.path.join(a, "q_dec.npy"), 1)
    out = run(np, "sp_bench", base + replay + ["--dim-v", dv, "--new-tokens", n], expect_rc=1)
    check(f"q_dec.npy: shape [{', '.join(map(str, shape))}] holds 0 decode tokens" in out, f"no 0-token error:\n{out}")


def test_comm(tmp):
    """comm_bench: dtype and reduction columns, in-place rows, combined patterns, too-small sizes, the summary."""
    path = os.path.join(tmp, "comm.json")
    out = run(2, "comm_bench", ["--ring-size", 2, "--min-bytes", 4, "--max-bytes", 1024, "--factor", 4,
                                "--warmup", 1, "--iters", 2, "--dtype", "bf16", "--groups", "ring", "--json", path])
    check(re.search(r"^# Avg bus bandwidth\s*:\s*[0-9.]+", out, re.M), f"no average bus bandwidth line:\n{out}")
    check(re.search(r"^# wrong elements in total: 0$", out, re.M), f"wrong elements:\n{out}")
    rows = [l.split() for l in out.splitlines() if l and not l.startswith("#")]
    ops = {r[0] for r in rows}
    for op in ("sendrecv", "alltoall", "allgather", "reducescatter", "allreduce", "ring_step", "ulysses_qkv"):
        check(op in ops, f"no {op} rows in:\n{out}")
    check(all(r[3] == "bf16" for r in rows), "every row names the data type")
    check({r[4] for r in rows if r[0] in ("reducescatter", "allreduce")} == {"sum"}, "reductions name their op")
    check(any(r[5] == "in" for r in rows) and any(r[5] == "out" for r in rows), "in-place and out-of-place rows")
    small = [r for r in rows if r[-1] == "too-small"]
    check(small, f"sizes below a pattern's minimum must be reported as too-small:\n{out}")
    j = json.load(open(path))
    check(isinstance(j.get("avg_busbw_gbps"), float), "JSON avg_busbw_gbps")
    kinds = {(r["op"], r["in_place"], r["status"]) for r in j["results"]}
    check(("ulysses_qkv", False, "ok") in kinds and ("allreduce", True, "ok") in kinds, f"JSON rows: {kinds}")
    check(any(s == "too-small" for _, _, s in kinds), "JSON too-small rows")
    check(all(r["dtype"] == "bf16" for r in j["results"]), "JSON dtype")


def test_sweep(tmp):
    """sweep.py for every kind at 1-2 ranks, then plot.py: labels, algorithms and the CSV's columns."""
    csv_path, png = os.path.join(tmp, "sweep.csv"), os.path.join(tmp, "scaling.png")
    sweep = [sys.executable, os.path.join(ARGS.scripts, "sweep.py"), "--sp-bench",
             os.path.join(ARGS.bin_dir, "sp_bench"), "--mpirun", ARGS.mpiexec, "--ranks", "1,2", "--warmup", "0",
             "--iters", "2", "--out", csv_path]
    # mha without --kv-heads: as many as --heads (sp_bench's default); gdn with 1 key head for 2 value heads.
    cases = [("mha", ["--seqs", "256", "--heads", "2", "--head-dim", "16", "--algos", "p2p,allgather,ulysses"]),
             ("gdn", ["--seqs", "256", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--extra",
                      "--chunk-size 16"]),
             ("dsa", ["--seqs", "256", "--heads", "2", "--head-dim", "16", "--extra",
                      "--topk 16 --indexer-heads 2 --indexer-dim 8"])]
    rows = []
    for kind, extra in cases:
        p = subprocess.run(sweep + ["--attn", kind] + extra + ["--append"] * bool(rows), capture_output=True,
                           text=True, timeout=600)
        check(p.returncode == 0, f"sweep.py --attn {kind}: exit {p.returncode}\n{p.stdout}{p.stderr}")
        rows = list(csv.DictReader(open(csv_path)))
    by_kind = {}
    for r in rows:
        by_kind.setdefault(r["attn"], set()).add(r["algo"])
        check(r["time_min_ms"] and float(r["time_min_ms"]) <= float(r["time_ms"]) <= float(r["time_max_ms"]),
              f"spread of {r}")
    check(by_kind.get("mha") == {"1rank", "p2p", "allgather", "ulysses"}, f"mha algorithms {by_kind.get('mha')}")
    check(by_kind.get("gdn") == {"1rank", "chain", "scan"}, f"gdn algorithms {by_kind.get('gdn')}")
    check(by_kind.get("dsa") == {"1rank", "ring", "allgather"}, f"dsa algorithms {by_kind.get('dsa')}")
    gdn = [r for r in rows if r["attn"] == "gdn"]
    check(all("Hkv" not in r["shape"] and "Hv=2 Hk=1 " in r["shape"] and "chunk=16" in r["shape"] for r in gdn),
          f"GDN shape labels {gdn[0]}")
    mha = [r for r in rows if r["attn"] == "mha"]
    check(all("Hq=2 Hkv=2 " in r["shape"] for r in mha), f"MHA shape labels {mha[0]}")
    check(all(r["mode"] == "train" for r in rows), "the mode column")
    one = [r for r in rows if r["ranks"] == "1"]
    check(all(abs(float(r["exposed_comm_pct"])) < 1e-9 for r in one), "one rank exposes no communication")
    for kind in ("mha", "gdn", "dsa"):
        out = os.path.join(tmp, f"{kind}.png")
        p = subprocess.run([ARGS.plot_python, os.path.join(ARGS.scripts, "plot.py"), csv_path, "--attn", kind,
                            "--out", out], capture_output=True, text=True, timeout=300)
        check(p.returncode == 0, f"plot.py --attn {kind}: exit {p.returncode}\n{p.stdout}{p.stderr}")
        head = open(out, "rb").read(24)
        check(head[:8] == b"\x89PNG\r\n\x1a\n", f"{out} is not a PNG")
        width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
        check(width >= 1500 and height >= 1000, f"{out}: {width} x {height} pixels, too small to read")


def kernel_flops(r):
    """The model FLOPs of a kernel_bench row (docs/benchmarks.md, "Definitions of the benchmark figures"), computed here from the row's shape, pair by pair."""
    if r["kernel"] == "mha":
        fwd = 4 * r["B"] * r["Hq"] * r["S"] * r["S"] * r["D"] * (0.5 if r["causal"] else 1.0)
        return fwd, 2.5 * fwd
    if r["kernel"] == "dsa":
        # query t sees keys 0..t (t + 1 candidates) and selects min(topk, t + 1) of them
        sel = sum(min(r["topk"], t + 1) for t in range(r["S"])) * r["B"]
        vis = sum(t + 1 for t in range(r["S"])) * r["B"]
        att, idx = 2 * r["H"] * (r["Dqk"] + r["Dv"]), 2 * r["Hi"] * r["Di"]
        return sel * att + vis * idx, sel * (2.5 * att + 3 * idx)
    c, k, v = min(r["chunk_size"], r["S"], 128), r["K"], r["V"]  # 128: attn::kGdnMaxChunkSize, the longest chunk run
    fwd = r["B"] * r["S"] * r["Hv"] * (6 * c * k + 4 * c * v + 6 * k * v)
    return fwd, 2.5 * fwd


def test_kernel(tmp):
    """kernel_bench --kernel all on small shapes: one table per kind, the JSON's metadata and rows, and every row's FLOPs,
    GFLOP/s and ratios against the formulas computed here."""
    path = os.path.join(tmp, "kernel.json")
    exe = os.path.join(ARGS.bin_dir, "kernel_bench")
    cmd = [exe, "--kernel", "all", "--seq", "96,128", "--dim", "32", "--mask", "both", "--hq", "2", "--hkv", "1",
           "--heads", "2", "--kv-heads", "1", "--head-dim", "32", "--dim-v", "16", "--topk", "8", "--indexer-heads",
           "2", "--indexer-dim", "16", "--chunk-size", "32", "--min-time", "0", "--warmup", "0", "--square", "64",
           "--threads", "1", "--json", path]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    check(p.returncode == 0, f"{' '.join(cmd)}: exit {p.returncode}\n{out}")
    for kind in ("mha", "dsa", "gdn"):
        check(re.search(rf"^# {kind}: ", out, re.M), f"no {kind} table header:\n{out}")
    check(re.search(r"^# square SGEMM 64\^3: [0-9.]+ GFLOP/s", out, re.M), f"no square SGEMM line:\n{out}")
    check_json_write_is_atomic(cmd, path)
    j = json.load(open(path))
    for key in ("benchmark", "version", "kernel", "threads", "openblas", "openblas_core", "square_n",
                "square_sgemm_gflops", "results"):
        check(key in j, f"kernel_bench JSON has no '{key}'")
    check(j["benchmark"] == "kernel_bench" and j["kernel"] == "all" and j["threads"] == 1, f"metadata {j}")
    check(j["square_sgemm_gflops"] > 0, "square SGEMM GFLOP/s")
    rows = j["results"]
    counts = {kind: sum(r["kernel"] == kind for r in rows) for kind in ("mha", "dsa", "gdn")}
    # mha: 2 lengths x 1 head dim x 2 masks; dsa and gdn: 2 lengths
    check(counts == {"mha": 4, "dsa": 2, "gdn": 2}, f"rows per kind {counts}")
    for r in rows:
        check(r["threads"] == 1 and r["rounds"] >= 1, f"row {r}")
        fwd, bwd = kernel_flops(r)
        for phase, want in (("fwd", fwd), ("bwd", bwd)):
            got = r[f"{phase}_flops"]
            check(abs(got - want) <= 1e-12 * want, f"{r['kernel']} S={r['S']} {phase}_flops {got} != {want}")
            check(r[f"{phase}_ms"] > 0 and r[f"{phase}_mean_ms"] >= r[f"{phase}_ms"], f"{phase} times of {r}")
            gf = want / (r[f"{phase}_ms"] * 1e-3) / 1e9
            check(abs(r[f"{phase}_gflops"] - gf) <= 1e-9 * gf, f"{r['kernel']} {phase}_gflops {r[f'{phase}_gflops']}")
            ratio = gf / j["square_sgemm_gflops"]
            check(abs(r[f"{phase}_ratio_square"] - ratio) <= 1e-9 * ratio, f"{r['kernel']} {phase}_ratio_square")
    # A --chunk-size above the kernels' longest chunk (128) runs as chunks of 128: the model counts those (it counted
    # C = 1000 and reported 6x the GFLOP/s of --chunk-size 128 at the same time), the row reports C = 128, and so does
    # the segment map's model (gdn_transition runs the same chunks; it counted C = S).
    long_path = os.path.join(tmp, "kernel_long_chunk.json")
    p = subprocess.run([exe, "--kernel", "gdn", "--seq", "256", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
                        "--dim-v", "16", "--chunk-size", "1000", "--min-time", "0", "--warmup", "0", "--square", "0",
                        "--threads", "1", "--gdn-maps", "--json", long_path], capture_output=True, text=True,
                       timeout=300)
    check(p.returncode == 0, f"kernel_bench --chunk-size 1000: exit {p.returncode}\n{p.stdout}{p.stderr}")
    for r in json.load(open(long_path))["results"]:
        check(r["chunk_size"] == 128, f"gdn --chunk-size 1000 S={r['S']}: the row reports chunk_size {r['chunk_size']}, "
              "not the 128 that runs")
        got, want = r["fwd_flops"], kernel_flops(r)[0]
        check(abs(got - want) <= 1e-12 * want, f"gdn --chunk-size 1000 S={r['S']}: fwd_flops {got} != {want} (C = 128)")
        c, k, v = 128, r["K"], r["V"]
        want = r["B"] * r["S"] * r["Hv"] * (4 * c * k + 2 * c * v + 4 * k * (k + v))
        check(abs(r["map_flops"] - want) <= 1e-12 * want,
              f"gdn --chunk-size 1000 S={r['S']}: map_flops {r['map_flops']} != {want} (C = 128)")
        # The per value-head windows without and with their work ahead (sp_plan --calibrate's gdn_work_ahead).
        for phase in ("fwd", "bwd"):
            for part in ("window", "ahead", "rest"):
                key = f"{part}_{phase}_mean_ms"
                check(key in r and r[key] > 0, f"gdn --gdn-maps S={r['S']}: {key} missing or not > 0 in {sorted(r)}")
    bad = subprocess.run([exe, "--kernel", "flash"], capture_output=True, text=True, timeout=60)
    check(bad.returncode != 0 and "--kernel flash must be mha, dsa, gdn or all" in bad.stderr,
          f"--kernel flash must be refused by name:\n{bad.stdout}{bad.stderr}")


def test_ops(tmp):
    """ops_bench --table cpu on small shapes: a GDN row per S with the forward and backward times and their model FLOP
    rates, a DSA row per S whose bytes, floors and of_floor are recomputed here from the shape, the GEMM rate and the
    bandwidth; --mem-bw given, 0 (FLOP floors only) and bad."""
    exe = os.path.join(ARGS.bin_dir, "ops_bench")
    shape = ["--table", "cpu", "--gdn-seq", "64,96", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--dim-v",
             "8", "--chunk-size", "32", "--dsa-seq", "80", "--dsa-heads", "2", "--dsa-dim", "24", "--dsa-dim-v", "16",
             "--indexer-heads", "2", "--indexer-dim", "8", "--topk", "16", "--square", "64", "--min-time", "0",
             "--warmup", "0", "--copy-mb", "1"]

    def bench(extra, name):
        path = os.path.join(tmp, name)
        p = subprocess.run([exe] + shape + extra + ["--json", path], capture_output=True, text=True, timeout=300)
        check(p.returncode == 0, f"ops_bench {' '.join(extra)}: exit {p.returncode}\n{p.stdout}{p.stderr}")
        return p.stdout, json.load(open(path))

    for extra, source in (([], "copy"), (["--mem-bw", "1e-6"], "given"), (["--mem-bw", "0"], "not measured")):
        out, rows = bench(extra, f"ops_{source.replace(' ', '_')}.json")
        gemm = [r for r in rows if r["kernel"] == "gemm_fp32"][0]["tflops"] * 1e12
        bw = [r for r in rows if r["kernel"] == "mem_bw"][0]
        check(bw["source"] == source, f"mem_bw row {bw}, expected source {source}")
        check((bw["gbs"] is None) == (source == "not measured"), f"mem_bw row {bw}")
        if source == "given":
            check(abs(bw["gbs"] - 1e-6) <= 1e-15, f"--mem-bw 1e-6 reported as {bw}")
        gdn = [r for r in rows if r["kernel"] == "gdn"]
        check([r["S"] for r in gdn] == [64, 96], f"gdn rows {[r['S'] for r in gdn]}, expected S 64, 96")
        for r in gdn:
            r["B"] = 1
            fwd, bwd = kernel_flops(r)
            for t, rate, of, flops in (("fwd_ms", "model_tflops", "of_gemm", fwd),
                                       ("bwd_ms", "bwd_model_tflops", "bwd_of_gemm", bwd)):
                check(r[t] > 0, f"gdn {t} of {r}")
                want = flops / (r[t] * 1e-3) * 1e-12
                check(abs(r[rate] - want) <= 1e-9 * want, f"gdn S={r['S']} {rate} {r[rate]} != {want}")
                check(abs(r[of] - want * 1e12 / gemm) <= 1e-9 * r[of], f"gdn S={r['S']} {of}")
            check(r["io_ms"] >= 0 and r["bwd_io_ms"] >= 0, f"gdn io times of {r}")
        dsa = [r for r in rows if r["kernel"] == "dsa"]
        check([r["S"] for r in dsa] == [80], f"dsa rows {dsa}")
        r = dsa[0]
        S, H, Dqk, Dv, Hi, Di, k = r["S"], r["H"], r["Dqk"], r["Dv"], r["Hi"], r["Di"], r["topk"]
        idx_flops = sum(t + 1 for t in range(S)) * 2 * Hi * Di
        att_flops = sum(min(k, t + 1) for t in range(S)) * 2 * H * (Dqk + Dv)
        # inputs once, outputs once: q_idx, w, k_idx -> topk (int64); q, c, topk -> out, lse
        idx_bytes = 4 * (S * Hi * Di + S * Hi + S * Di) + 8 * S * k
        att_bytes = 4 * (S * H * Dqk + S * Dqk) + 8 * S * k + 4 * (S * H * Dv + H * S)
        for stage, flops, nbytes in (("indexer", idx_flops, idx_bytes), ("attention", att_flops, att_bytes)):
            check(r[f"{stage}_model_flops"] == flops, f"dsa {stage}_model_flops {r[f'{stage}_model_flops']} != {flops}")
            check(r[f"{stage}_bytes"] == nbytes, f"dsa {stage}_bytes {r[f'{stage}_bytes']} != {nbytes}")
            tf, tb = flops / gemm, (nbytes / (bw["gbs"] * 1e9) if bw["gbs"] else 0.0)
            want, bound = (tb, "bytes") if tb > tf else (tf, "flops")
            check(abs(r[f"{stage}_floor_ms"] - want * 1e3) <= 1e-9 * want * 1e3, f"dsa {stage}_floor_ms {r}")
            check(r[f"{stage}_floor_bound"] == bound, f"dsa {stage} bound {r[f'{stage}_floor_bound']}, want {bound}")
            of = want * 1e3 / r[f"{stage}_ms"]
            check(abs(r[f"{stage}_of_floor"] - of) <= 1e-9 * of, f"dsa {stage}_of_floor {r[f'{stage}_of_floor']} != {of}")
        if source == "given":  # 1 kB/s: both stages byte-bound
            check(r["indexer_floor_bound"] == "bytes" and r["attention_floor_bound"] == "bytes", f"1 kB/s: {r}")
        if source == "not measured":
            check("not measured" in out, f"--mem-bw 0 must say the bandwidth is not measured:\n{out}")
    check_json_write_is_atomic([exe] + shape + ["--mem-bw", "0", "--json", os.path.join(tmp, "ops_not_measured.json")],
                               os.path.join(tmp, "ops_not_measured.json"))
    bad = subprocess.run([exe, "--mem-bw", "-3"], capture_output=True, text=True, timeout=60)
    check(bad.returncode != 0 and "--mem-bw must be -1 (measure), 0 (not measured) or a positive GB/s, got -3"
          in bad.stderr, f"--mem-bw -3 must be refused by name:\n{bad.stdout}{bad.stderr}")


def main():
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mpiexec", default="mpirun")
    ap.add_argument("--np-flag", default="-np")
    ap.add_argument("--bin-dir", required=True, help="directory holding sp_bench, comm_bench and kernel_bench")
    ap.add_argument("--scripts", default=os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    ap.add_argument("--plot-python", default="/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable,
                    help="the Python with matplotlib (Debian's python3-matplotlib: /usr/bin/python3)")
    ap.add_argument("what", choices=["json", "memory", "roundtrip", "decode-grids", "decode-replay", "comm", "sweep", "kernel", "ops"])
    ap.add_argument("--np", type=int, default=2)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    ARGS = ap.parse_args(argv[:cut])
    flags = argv[cut + 1:]  # sp_bench flags after "--" (memory, roundtrip)
    with tempfile.TemporaryDirectory(prefix="seqpar_instr_") as tmp:
        if ARGS.what == "json":
            test_json(tmp)
        elif ARGS.what == "memory":
            test_memory(tmp, ARGS.np, flags)
        elif ARGS.what == "roundtrip":
            test_roundtrip(tmp, ARGS.np, flags)
        elif ARGS.what == "decode-grids":
            test_decode_grids(tmp, ARGS.np, flags)
        elif ARGS.what == "decode-replay":
            test_decode_replay(tmp, ARGS.np, flags)
        elif ARGS.what == "comm":
            test_comm(tmp)
        elif ARGS.what == "kernel":
            test_kernel(tmp)
        elif ARGS.what == "ops":
            test_ops(tmp)
        else:
            test_sweep(tmp)
    print("passed")


if __name__ == "__main__":
    main()
