#!/usr/bin/env python3
"""sp_bench --inputs and the shape flags: the shapes come from the files when their flags are not given,
and a shape flag that is given must match its file, else every rank stops naming the flag, the file and its shape.

Writes small fp32 .npy inputs (plain Python, no numpy) for MHA, DSA and GDN, runs sp_bench under mpirun and checks
the exit status and the output. Exit status 0 when every case passed.

usage: sp_bench_inputs.py --mpiexec MPIEXEC --np N --sp-bench SP_BENCH [--np-flag -n]
"""
import argparse
import os
import random
import re
import struct
import subprocess
import sys
import tempfile


def write_npy(path, shape, seed, lo=-1.0, hi=1.0):
    """A version 1.0 .npy file of little-endian fp32, C order, uniform values in [lo, hi)."""
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': %s, }" % (tuple(shape),)
    header += " " * (-(10 + len(header) + 1) % 64) + "\n"
    count = 1
    for d in shape:
        count *= d
    rng = random.Random(seed)
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1"))
        f.write(struct.pack("<%df" % count, *(rng.uniform(lo, hi) for _ in range(count))))


def make_inputs(directory, tensors):
    os.makedirs(directory, exist_ok=True)
    for seed, (name, shape, lo, hi) in enumerate(tensors):
        write_npy(os.path.join(directory, name + ".npy"), shape, seed, lo, hi)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mpiexec", required=True)
    ap.add_argument("--np-flag", default="-n")
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--sp-bench", required=True)
    a = ap.parse_args()

    work = tempfile.mkdtemp(prefix="sp_bench_inputs.")
    mha, dsa, gdn, gdn_grouped, gdn_conv = (os.path.join(work, k)
                                            for k in ("mha", "dsa", "gdn", "gdn_grouped", "gdn_conv"))
    make_inputs(mha, [("q", [1, 64, 4, 16], -1, 1), ("k", [1, 64, 2, 16], -1, 1), ("v", [1, 64, 2, 16], -1, 1),
                      ("dout", [1, 64, 4, 16], -1, 1)])
    make_inputs(dsa, [("q", [1, 32, 4, 32], -1, 1), ("c", [1, 32, 32], -1, 1), ("q_idx", [1, 32, 2, 16], -1, 1),
                      ("k_idx", [1, 32, 16], -1, 1), ("w", [1, 32, 2], -1, 1), ("dout", [1, 32, 4, 16], -1, 1)])
    make_inputs(gdn, [("q", [1, 48, 2, 16], -1, 1), ("k", [1, 48, 2, 16], -1, 1), ("v", [1, 48, 2, 16], -1, 1),
                      ("g", [1, 48, 2], -0.22, -0.02), ("beta", [1, 48, 2], 0.2, 0.8),
                      ("initial_state", [1, 2, 16, 16], -0.1, 0.1), ("dout", [1, 48, 2, 16], -1, 1)])
    # Grouped value heads: one key head (q, k [.., 1, K = 16]) serves two value heads (v [.., 2, V = 8]).
    make_inputs(gdn_grouped, [("q", [1, 48, 1, 16], -1, 1), ("k", [1, 48, 1, 16], -1, 1), ("v", [1, 48, 2, 8], -1, 1),
                              ("g", [1, 48, 2], -0.22, -0.02), ("beta", [1, 48, 2], 0.2, 0.8),
                              ("initial_state", [1, 2, 16, 8], -0.1, 0.1), ("dout", [1, 48, 2, 8], -1, 1)])
    # Out of the recurrence's domain: g > 0 (a growing state), beta > 1.
    gdn_bad = {}
    for bad, (lo_g, hi_g, lo_b, hi_b) in {"g": (0.01, 0.2, 0.2, 0.8), "beta": (-0.22, -0.02, 1.1, 1.5)}.items():
        gdn_bad[bad] = os.path.join(work, "gdn_bad_" + bad)
        make_inputs(gdn_bad[bad], [("q", [1, 48, 2, 16], -1, 1), ("k", [1, 48, 2, 16], -1, 1),
                                   ("v", [1, 48, 2, 16], -1, 1), ("g", [1, 48, 2], lo_g, hi_g),
                                   ("beta", [1, 48, 2], lo_b, hi_b), ("initial_state", [1, 2, 16, 16], -0.1, 0.1),
                                   ("dout", [1, 48, 2, 16], -1, 1)])
    # A short conv of width 3 on q, k, v: conv_weight [2 Hk K + Hv V, W] = [96, 3].
    make_inputs(gdn_conv, [("q", [1, 48, 2, 16], -1, 1), ("k", [1, 48, 2, 16], -1, 1), ("v", [1, 48, 2, 16], -1, 1),
                           ("g", [1, 48, 2], -0.22, -0.02), ("beta", [1, 48, 2], 0.2, 0.8),
                           ("initial_state", [1, 2, 16, 16], -0.1, 0.1), ("dout", [1, 48, 2, 16], -1, 1),
                           ("conv_weight", [96, 3], -0.5, 0.5)])

    grid = ["--ring-size", str(a.np)]
    run = ["--check", "--quiet", "--warmup", "0", "--iters", "1"]
    every_rank = lambda line: "".join(".*rank [0-9]+: error: " + line for _ in range(a.np))
    # (name, flags, expect success, regex the output must match)
    cases = [
        ("mha shapes from the files", ["--inputs", mha, "--causal"], True,
         r"# shapes B=1 S=64 Hq=4 Hkv=2 D=16 causal=yes.*# check passed"),
        ("mha flags that match the files", ["--inputs", mha, "--seq", "64", "--heads", "4", "--kv-heads", "2"], True,
         r"# shapes B=1 S=64 Hq=4 Hkv=2 D=16.*# check passed"),
        ("mha --heads against q.npy", ["--inputs", mha, "--heads", "8"], False,
         every_rank(r"--heads 8 does not match --inputs: \S*q\.npy has shape \[1, 64, 4, 16\] \(dimension 2 is 4\); "
                    r"leave --heads out to take it from the file")),
        ("mha --seq against q.npy", ["--inputs", mha, "--seq", "128"], False,
         every_rank(r"--seq 128 does not match --inputs: \S*q\.npy has shape \[1, 64, 4, 16\] \(dimension 1 is 64\)")),
        ("mha --kv-heads against k.npy", ["--inputs", mha, "--kv-heads", "4"], False,
         every_rank(r"--kv-heads 4 does not match --inputs: \S*k\.npy has shape \[1, 64, 2, 16\]")),
        ("dsa shapes from the files", ["--attn", "dsa", "--topk", "8", "--inputs", dsa], True,
         r"# shapes B=1 S=32 Hq=4 Dqk=32 causal=yes Dv=16 topk=8 indexer Hi=2 Di=16.*# check passed"),
        ("dsa --indexer-dim against q_idx.npy", ["--attn", "dsa", "--topk", "8", "--inputs", dsa, "--indexer-dim",
                                                  "32"], False,
         every_rank(r"--indexer-dim 32 does not match --inputs: \S*q_idx\.npy has shape \[1, 32, 2, 16\]")),
        ("gdn shapes from the files", ["--attn", "gdn", "--chunk-size", "16", "--inputs", gdn], True,
         r"# shapes B=1 S=48 Hv=2 Hk=2 K=16 V=16 .*# check passed"),
        ("gdn grouped value heads from the files", ["--attn", "gdn", "--chunk-size", "16", "--inputs", gdn_grouped],
         True, r"# shapes B=1 S=48 Hv=2 Hk=1 K=16 V=8 .*# check passed"),
        ("gdn --dim-v against v.npy", ["--attn", "gdn", "--chunk-size", "16", "--inputs", gdn_grouped, "--dim-v",
                                       "16"], False,
         every_rank(r"--dim-v 16 does not match --inputs: \S*v\.npy has shape \[1, 48, 2, 8\]")),
        ("gdn conv width from conv_weight.npy", ["--attn", "gdn", "--chunk-size", "16", "--inputs", gdn_conv], True,
         r"# shapes B=1 S=48 Hv=2 Hk=2 K=16 V=16 conv=3 .*dconv_weight .*# check passed"),
        ("gdn --conv-width against conv_weight.npy", ["--attn", "gdn", "--chunk-size", "16", "--inputs", gdn_conv,
                                                      "--conv-width", "4"], False,
         every_rank(r"--conv-width 4 does not match --inputs: \S*conv_weight\.npy has shape \[96, 3\]")),
        ("gdn --conv-width without conv_weight.npy", ["--attn", "gdn", "--chunk-size", "16", "--inputs", gdn,
                                                      "--conv-width", "3"], False,
         every_rank(r"--conv-width 3 needs --inputs \S*conv_weight\.npy, which does not exist \(leave --conv-width "
                    r"out to run without conv_weight\)")),
        ("gdn g > 0", ["--attn", "gdn", "--chunk-size", "16", "--inputs", gdn_bad["g"]], False,
         every_rank(r"\S*/g\.npy: element 0 is [0-9.e-]+ \(--attn gdn: g is the log decay, every element must be "
                    r"<= 0\)")),
        ("gdn beta > 1", ["--attn", "gdn", "--chunk-size", "16", "--inputs", gdn_bad["beta"]], False,
         every_rank(r"\S*/beta\.npy: element 0 is [0-9.e-]+ \(--attn gdn: beta must be in \(0, 1\)\)")),
    ]
    failed = 0
    for name, flags, ok, regex in cases:
        cmd = [a.mpiexec, a.np_flag, str(a.np), a.sp_bench] + grid + run + flags
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
        good = (p.returncode == 0) == ok and re.search(regex, p.stdout, re.S) is not None
        print(("PASS" if good else "FAIL") + f": {name} (exit {p.returncode})")
        if not good:
            failed += 1
            print("  command: " + " ".join(cmd) + "\n  expected " + ("success" if ok else "failure") +
                  " matching: " + regex + "\n" + p.stdout)
    print(f"{len(cases) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
