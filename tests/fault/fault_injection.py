#!/usr/bin/env python3
"""Fault injection under mpirun (issue: failure paths stay clean).

Runs sp_bench for one workload, first cleanly with SEQPAR_FAULT=count to learn how many communication calls and
ledger allocations a rank makes, then with each injected fault (runtime/fault.h) at a few points: the first
communication call, the middle of the forward's and of the backward's group calls (the count run lists every call
with its group), an out-of-memory at two allocations, and a rank that stalls in the backward longer than
SEQPAR_COMM_TIMEOUT_S. Every faulty run must:
  - exit with status 1 (MPI_Abort from run_mpi_main), never by a signal (SIGSEGV, SIGABRT) or a hang;
  - print a "rank N: error: ..." line naming the cause (the injected fault, out of memory, or the timeout), and at
    most one such line per rank (the others say that the job's abort stopped them);
  - print no crash marker (segmentation fault, std::terminate, core dumped, AddressSanitizer);
  - end within the communication timeout + 10 s after the clean run's own duration;
  - leave each output file (--json, --dump) either complete or absent, and no temporary file behind.

usage: fault_injection.py --mpiexec MPIEXEC --np N --sp-bench SP_BENCH [--np-flag -n] -- <sp_bench args>
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

TIMEOUT_S = 4  # SEQPAR_COMM_TIMEOUT_S of the faulty runs
CRASH_MARKERS = ("Segmentation fault", "signal 11", "signal 6", "terminate called", "core dumped",
                 "AddressSanitizer", "Aborted")


def run(cmd, env, limit_s):
    start = time.monotonic()
    try:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=limit_s)
        return p.returncode, p.stdout, time.monotonic() - start
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out, time.monotonic() - start


def npy_complete(path):
    """True when the .npy file's header parses and the data it announces is all there."""
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(b"\x93NUMPY"):
        return False
    major = data[6]
    hlen = int.from_bytes(data[8:10], "little") if major == 1 else int.from_bytes(data[8:12], "little")
    hstart = 10 if major == 1 else 12
    header = data[hstart:hstart + hlen].decode("latin1")
    m_shape = re.search(r"'shape':\s*\(([^)]*)\)", header)
    m_descr = re.search(r"'descr':\s*'([<>|]?)([a-zA-Z])(\d+)'", header)
    if not m_shape or not m_descr:
        return False
    count = 1
    for dim in m_shape.group(1).split(","):
        if dim.strip():
            count *= int(dim)
    return len(data) == hstart + hlen + count * int(m_descr.group(3))


def check_outputs(workdir, problems):
    json_path = os.path.join(workdir, "result.json")
    if os.path.exists(json_path):
        try:
            with open(json_path) as f:
                json.load(f)
        except ValueError as e:
            problems.append(f"result.json exists but is not complete JSON: {e}")
    dump = os.path.join(workdir, "dump")
    for root, _, files in os.walk(workdir):
        for name in files:
            path = os.path.join(root, name)
            if name.endswith(".npy"):
                if not npy_complete(path):
                    problems.append(f"{path} is a truncated .npy")
            elif path != json_path:
                problems.append(f"unexpected file left behind: {path}")
    return dump


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mpiexec", required=True)
    ap.add_argument("--np-flag", default="-n")
    ap.add_argument("--np", type=int, required=True)
    ap.add_argument("--sp-bench", required=True)
    ap.add_argument("bench_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    bench_args = [x for x in a.bench_args if x != "--"]

    base_env = dict(os.environ)
    base_env.pop("SEQPAR_FAULT", None)
    failures = []

    def sp_bench(fault, workdir, limit_s, timeout_s=None):
        env = dict(base_env)
        env["SEQPAR_FAULT"] = fault
        if timeout_s:
            env["SEQPAR_COMM_TIMEOUT_S"] = str(timeout_s)
        cmd = [a.mpiexec, a.np_flag, str(a.np), a.sp_bench, "--warmup", "0", "--iters", "2", "--quiet",
               "--json", os.path.join(workdir, "result.json"), "--dump", os.path.join(workdir, "dump")] + bench_args
        return run(cmd, env, limit_s)

    # 1. Clean run, counting rank 1's communication calls and allocations (rank 0 when alone).
    count_rank = 1 if a.np > 1 else 0
    with tempfile.TemporaryDirectory() as workdir:
        rc, out, clean_s = sp_bench(f"count,rank={count_rank}", workdir, 300)
        m = re.search(r"SEQPAR_FAULT count: (\d+) communication calls, (\d+) allocations", out)
        if rc != 0 or not m:
            print(out)
            print(f"FAIL: the clean counting run exited {rc} or printed no count")
            return 1
        calls, allocs = int(m.group(1)), int(m.group(2))
        m_ops = re.search(r"SEQPAR_FAULT calls: (.*)", out)
        ops = m_ops.group(1).split(",") if m_ops else []
        if calls < 4 or allocs < 4:
            print(out)
            print(f"FAIL: the counting run saw {calls} communication calls and {allocs} allocations; "
                  "the fault points need at least 4 of each (is the Communicator front-end counting?)")
            return 1
    print(f"# clean run: {clean_s:.1f} s, rank {count_rank}: {calls} communication calls, {allocs} allocations")

    # The layer's own traffic: runs of calls on the CP groups (ulysses, ring, cp), between sp_bench's world-wide
    # reductions. The first run is the first iteration's forward, the second its backward.
    runs, current = [], []
    for i, op in enumerate(ops, start=1):
        if op.startswith("world:"):
            if current:
                runs.append(current)
            current = []
        else:
            current.append(i)
    if current:
        runs.append(current)
    if len(runs) < 2:
        print(f"FAIL: expected the forward and backward as two runs of group calls, got {ops}")
        return 1
    fwd_mid = runs[0][len(runs[0]) // 2]
    bwd_mid = runs[1][len(runs[1]) // 2]
    print(f"# forward calls {runs[0][0]}..{runs[0][-1]}, backward calls {runs[1][0]}..{runs[1][-1]}")
    last = a.np - 1
    cases = [
        ("comm_error at the first call", f"comm_error,rank=0,at=1", "injected fault"),
        ("comm_error mid-forward", f"comm_error,rank={count_rank},at={fwd_mid}", "injected fault"),
        ("comm_error mid-backward", f"comm_error,rank={count_rank},at={bwd_mid}", "injected fault"),
        ("oom mid-run", f"oom,rank={count_rank},at={max(1, allocs // 2)}", "out of memory"),
        ("oom late", f"oom,rank={last},at={max(1, 9 * allocs // 10)}", "out of memory"),
        ("stall in the backward", f"stall,rank={count_rank},at={bwd_mid},seconds={TIMEOUT_S + 6}",
         "did not complete within"),
    ]
    for name, fault, cause in cases:
        with tempfile.TemporaryDirectory() as workdir:
            bound = clean_s + TIMEOUT_S + 10
            rc, out, took = sp_bench(fault, workdir, bound + 60, TIMEOUT_S)
            problems = []
            if rc is None:
                problems.append(f"hung: still running after {bound + 60:.0f} s")
            elif rc != 1:
                problems.append(f"exit status {rc}, expected 1" + (" (killed by a signal)" if rc < 0 else ""))
            if took > bound:
                problems.append(f"took {took:.1f} s, more than the bound {bound:.1f} s")
            error_lines = [l for l in out.splitlines() if re.match(r"rank \d+: error: ", l)]
            if not any(cause in l for l in error_lines):
                problems.append(f"no 'rank N: error:' line names the cause '{cause}'")
            # A rank says at most once why it ended: its own error, or that the job's abort stopped it (SIGTERM; best
            # effort: mpirun may kill a rank before its line is forwarded).
            per_rank = [sum(1 for l in error_lines if l.startswith(f"rank {r}: error: ")) for r in range(a.np)]
            if max(per_rank) > 1:
                problems.append(f"'rank N: error:' lines per rank are {per_rank}, expected at most one each")
            for marker in CRASH_MARKERS:
                if marker in out:
                    problems.append(f"crash marker in the output: '{marker}'")
            check_outputs(workdir, problems)
            status = "ok" if not problems else "FAIL"
            print(f"{status:4} {name:32} SEQPAR_FAULT={fault:40} rc={rc} {took:5.1f} s")
            for l in error_lines[:2]:
                print(f"       {l[:200]}")
            if problems:
                failures.append(name)
                for p in problems:
                    print(f"       problem: {p}")
                print("------ output ------\n" + out[-4000:] + "\n--------------------")
    print(f"{len(cases) - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
