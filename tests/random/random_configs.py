#!/usr/bin/env python3
"""Seeded random configurations of sp_bench, each checked against one rank and against the fp64 reference.

Each run draws a fresh seed (unless --seed or SEQPAR_RANDOM_SEED gives one), prints it with the one command that
reproduces the run, then generates --count small valid configurations across grids (1, 2, 3, 4, 6 and 8 ranks,
Ulysses x ring), layouts, dtypes, packed rows (--doc-lens, with 1-token documents and documents longer than a rank's
share), variants (windows up to the whole row, so across ranks; dropout, softcap, ALiBi, sinks, RoPE with each pairing
and scaling), kinds (MHA, DSA with tied indexer scores, GDN chain / scan with the short conv, 1 to 4 value heads per
rank and the work ahead on or off: SEQPAR_GDN_WORK_AHEAD), ring implementations, the lowered test mode
(SEQPAR_LOWERED_ATTENTION=1: sp_bench links no ops-table hook, so it lowers MHA and MHA decode only), decode of every
kind (cache sharding, batch, MHA chunk prefill routes, DSA windows, GDN short conv) and dynamic CP (an sp_plan
--dynamic-cp plan run by dyncp_bench, then its largest micro-batch under sp_bench --check-against reference). Each
configuration runs twice under mpirun: `--check` (the one-rank kernel, then the fp64 rule) and `--check-against
reference` (the fp64 reference); a dynamic-CP one runs dyncp_bench, then the micro-batch check. A run fails on a
check that fails, a crash (a signal, or an exit without a result), a hang (past --timeout) or a refusal (a valid
configuration must run). Then a handful of invalid configurations, each of which
must end with exit status 1 and one identical "rank N: error: ..." line on every rank.

Every failure prints the sp_bench command line that reproduces it and a minimal one (flags dropped one at a time
while the run still fails the same way). Exit status 0 when every case passed.

usage: random_configs.py --mpiexec MPIEXEC --sp-bench SP_BENCH [--np-flag -n] [--seed N] [--count N] [--timeout S]
                         [--sp-plan SP_PLAN --dyncp-bench DYNCP_BENCH] (default: beside sp_bench; the dynamic-CP
                         configurations are skipped when either is missing)
"""
import argparse
import json
import os
import random
import re
import shlex
import signal
import struct
import subprocess
import sys
import tempfile
import time

# Configurations that hit a known, open bug: skipped (and counted) until its fix lands; each entry is a
# (reason, predicate on the configuration) pair. Empty: no known bug.
KNOWN_BUGS = [
]


class Config(dict):
    """One configuration: np, ulysses, ring, the sp_bench flags (a list) and its environment (env, a dict of
    variables set for the run) plus the fields KNOWN_BUGS reads."""

    def argv(self):
        return list(self["flags"])

    def env(self):
        return dict(self.get("env", {}))


def pick_grid(rng):
    """(np, pu, pr): 3, 6 and 8 ranks (oversubscribed) one draw in eight each, as Ulysses x ring grids of every
    shape (6: 1x6, 2x3, 3x2, 6x1; 8: 1x8, 2x4, 4x2, 8x1)."""
    np_ = rng.choice([1, 2, 2, 3, 4, 4, 6, 8])
    pu = rng.choice([d for d in (1, 2, 3, 4, 6, 8) if np_ % d == 0])
    return np_, pu, np_ // pu


def pick_train_grid(rng):
    """(np, dp, pu, pr, flags): sometimes two data-parallel replicas."""
    np_, pu, pr = pick_grid(rng)
    dp = 1
    if np_ % 2 == 0 and rng.random() < 0.15:
        dp = 2
        if pr % 2 == 0:
            pr //= 2
        else:
            pu //= 2
    flags = ["--ulysses-size", str(pu), "--ring-size", str(pr)] + (["--dp-size", "2"] if dp > 1 else [])
    return np_, dp, pu, pr, flags


def doc_lens(rng, total_min, total_max):
    """Document lengths: 1 to 4 of any length (zero-length ones too) four times in ten; else odd shapes: runs of
    1-token documents around a few others, or one document of at least half the row (longer than a rank's share on
    any ring of 2 or more) among short ones."""
    shape = rng.random()
    if shape < 0.4:
        n = rng.randint(1, 4)
        lens = [rng.randint(0 if rng.random() < 0.15 else 1, total_max // n) for _ in range(n)]
    elif shape < 0.7:
        lens = [1] * rng.randint(2, 8) + [rng.randint(1, total_max // 4) for _ in range(rng.randint(0, 2))]
        rng.shuffle(lens)
    else:
        long_doc = rng.randint(total_max // 2, total_max - total_max // 4)
        lens = [long_doc] + [rng.choice([1, 1, 2, 3, rng.randint(1, total_max // 8)]) for _ in range(rng.randint(0, 4))]
        rng.shuffle(lens)
    if sum(lens) < total_min:
        lens[-1] += total_min - sum(lens)
    return lens


def row_flags(rng, c, longest):
    """The rows' flags: packed documents of 1 to `longest` tokens in all (--doc-lens, kept in c["doc_lens"]) four times
    in ten, else --seq (1 to `longest`) and --batch. The row's length goes to c["seq"]."""
    if rng.random() < 0.4:
        lens = doc_lens(rng, 1, longest)
        c["doc_lens"] = lens
        c["seq"] = sum(lens)
        return ["--doc-lens", ",".join(map(str, lens))]
    c["seq"] = rng.randint(1, longest)
    return ["--seq", str(c["seq"]), "--batch", str(rng.choice([1, 2]))]


def window_flags(rng, c):
    """--window: short (1 to 24 tokens) four times in ten, else from a rank's share of the row to the whole row (a
    window that crosses ranks)."""
    share = max(1, c["seq"] // (c["ring"] * c["ulysses"]))
    w = rng.randint(1, 24) if rng.random() < 0.4 else rng.randint(share, max(share, c["seq"]))
    c["window"] = w
    return ["--window", str(w)]


def rope_flags(rng, hd, rope_dim=None):
    """--rope with either pairing, a partial width sometimes, and a frequency scaling (llama3, yarn) or another theta
    half the time."""
    f = ["--rope", rng.choice(["rotate-half", "interleaved"])]
    if rope_dim is not None:
        f += ["--rope-dim", str(rope_dim)]
    elif rng.random() < 0.5:
        f += ["--rope-dim", str(rng.choice([4, hd]))]
    extra = rng.random()
    if extra < 0.2:
        f += ["--rope-scaling", "llama3", "--rope-factor", "8", "--rope-original-max-pos", "16"]
    elif extra < 0.4:
        f += ["--rope-scaling", "yarn", "--rope-factor", "4", "--rope-original-max-pos", "16"]
    elif extra < 0.5:
        f += ["--rope-theta", "500000"]
    return f


def maybe_lowered(rng, c, p):
    """SEQPAR_LOWERED_ATTENTION=1 with probability p (the device schedule and masked rectangles of MHA, on the host)."""
    if rng.random() < p:
        c.setdefault("env", {})["SEQPAR_LOWERED_ATTENTION"] = "1"


def mha_config(rng):
    np_, dp, pu, pr, grid = pick_train_grid(rng)
    heads = pu * rng.choice([1, 2])
    kv = rng.choice([d for d in range(1, heads + 1) if heads % d == 0 and (d % pu == 0 or pu % d == 0)])
    hd = rng.choice([8, 16])
    dtype = rng.choice(["fp32", "fp32", "fp64", "bf16", "fp16"])
    layout = rng.choice(["contiguous", "zigzag", "stripe", "balanced"])
    c = Config(np=np_, ulysses=pu, ring=pr, layout=layout, attn="mha")
    f = ["--attn", "mha"] + grid + ["--layout", layout, "--heads", str(heads),
         "--kv-heads", str(kv), "--head-dim", str(hd), "--dtype", dtype, "--impl", rng.choice(["p2p", "allgather"])]
    if pu > 1 and pr > 1:
        f += ["--placement", rng.choice(["ulysses_inner", "ring_inner"])]
    causal = rng.random() < 0.7
    if causal:
        f.append("--causal")
    f += row_flags(rng, c, 80)
    if causal and rng.random() < 0.5:
        f += window_flags(rng, c)
    if rng.random() < 0.25:
        p = rng.choice([0.1, 0.25, 0.5])
        c["dropout"] = p
        f += ["--dropout", str(p), "--dropout-seed", str(rng.randint(0, 99))]
    if rng.random() < 0.2:
        f += ["--softcap", rng.choice(["5", "30"])]
    if rng.random() < 0.2:
        f.append("--alibi")
    if rng.random() < 0.2:
        f.append("--sinks")
    if rng.random() < 0.5:
        f += rope_flags(rng, hd)
    maybe_lowered(rng, c, 0.35)
    c["flags"] = f
    return c


def dsa_config(rng, inputs_dir):
    np_, dp, pu, pr, grid = pick_train_grid(rng)
    heads = pu * rng.choice([1, 2])
    hd = rng.choice([16, 32])
    dtype = rng.choice(["fp32", "fp32", "fp64", "bf16", "fp16"])
    layout = rng.choice(["contiguous", "zigzag", "stripe", "balanced"])
    c = Config(np=np_, ulysses=pu, ring=pr, layout=layout, attn="dsa")
    f = ["--attn", "dsa"] + grid + ["--layout", layout, "--heads", str(heads),
         "--head-dim", str(hd), "--dim-v", str(rng.choice([8, hd])), "--indexer-heads", str(rng.choice([1, 2])),
         "--indexer-dim", "8", "--topk", str(rng.randint(1, 24)), "--dtype", dtype,
         "--dsa-select", rng.choice(["ring", "allgather"])]
    if pu > 1 and pr > 1:
        f += ["--placement", rng.choice(["ulysses_inner", "ring_inner"])]
    seq = rng.randint(1, 64)
    if rng.random() < 0.3:
        # Tied indexer scores: every key row of the indexer is one of two vectors, so most scores tie and the top-k
        # must break ties alike on every grid.
        d = os.path.join(inputs_dir, "dsa_ties_%d" % len(os.listdir(inputs_dir)))
        ih = int(f[f.index("--indexer-heads") + 1])
        dv = int(f[f.index("--dim-v") + 1])
        write_dsa_tied_inputs(d, rng, seq, heads, hd, dv, ih, 8)
        f += ["--inputs", d]
    elif rng.random() < 0.4:
        lens = doc_lens(rng, 1, 64)
        c["doc_lens"] = lens
        seq = sum(lens)
        f += ["--doc-lens", ",".join(map(str, lens))]
    else:
        f += ["--seq", str(seq)]
    c["seq"] = seq
    if rng.random() < 0.4:
        f += window_flags(rng, c)
    if rng.random() < 0.5:
        f += rope_flags(rng, hd, 8)
    c["flags"] = f
    return c


def gdn_config(rng):
    np_, dp, pu, pr, grid = pick_train_grid(rng)
    # 1 to 4 value heads per rank: with the segments of a zigzag or packed layout, more windows (segment x head) than
    # the work ahead holds at once (kGdnAheadMaxWindows).
    heads = pu * rng.choice([1, 2, 4])
    kv = rng.choice([d for d in range(1, heads + 1) if heads % d == 0 and (d % pu == 0 or pu % d == 0)])
    layout = rng.choice(["contiguous", "zigzag", "balanced"])
    c = Config(np=np_, ulysses=pu, ring=pr, layout=layout, attn="gdn")
    f = ["--attn", "gdn"] + grid + ["--layout", layout, "--heads", str(heads),
         "--kv-heads", str(kv), "--head-dim", str(rng.choice([8, 16])), "--dim-v", str(rng.choice([8, 16])),
         "--chunk-size", str(rng.choice([1, 4, 8, 16, 64, 200])), "--gdn-mode", rng.choice(["chain", "scan"]),
         "--dtype", rng.choice(["fp32", "fp32", "fp64", "bf16", "fp16"])]
    if pu > 1 and pr > 1:
        f += ["--placement", rng.choice(["ulysses_inner", "ring_inner"])]
    if rng.random() < 0.5:
        f += ["--conv-width", str(rng.choice([2, 4]))]
    f += row_flags(rng, c, 64)
    if rng.random() < 0.4:
        c["env"] = {"SEQPAR_GDN_WORK_AHEAD": "0"}  # else on (the default)
    c["flags"] = f
    return c


def decode_config(rng):
    np_, pu, pr = pick_grid(rng)
    attn = rng.choice(["mha", "dsa", "gdn"])
    sp = pu * pr
    if attn == "gdn":
        heads = sp * rng.choice([1, 2])
        kv = rng.choice([d for d in range(sp, heads + 1, sp) if heads % d == 0])
    elif attn == "mha":
        kv = rng.choice([d for d in (1, 2, 3, 4) if d % pu == 0 or pu % d == 0])
        heads = max(kv, pu) * rng.choice([1, 2])
    else:
        kv = pu * rng.choice([1, 2])
        heads = kv * rng.choice([1, 2])
    layout = rng.choice(["contiguous", "zigzag", "balanced"] + ([] if attn == "gdn" else ["stripe"]))
    c = Config(np=np_, ulysses=pu, ring=pr, layout=layout, attn=attn, decode=True, kv_heads=kv)
    # A prompt shorter than the group (ranks holding no prompt token) one time in five.
    context = rng.randint(1, sp) if rng.random() < 0.2 else rng.randint(sp, 48)
    f = ["--mode", "decode", "--attn", attn, "--ulysses-size", str(pu), "--ring-size", str(pr), "--layout", layout,
         "--heads", str(heads), "--context", str(context), "--decode-steps", str(rng.randint(1, 4)),
         "--new-tokens", str(rng.choice([1, 1, 2, 3])), "--dtype", rng.choice(["fp32", "fp64", "bf16"]),
         "--batch", str(rng.choice([1, 1, 2]))]
    if attn == "dsa":
        f += ["--head-dim", "32", "--dim-v", "16", "--indexer-heads", "2", "--indexer-dim", "8", "--topk",
              str(rng.randint(1, 16))]
        if rng.random() < 0.4:
            f += ["--window", str(rng.randint(1, 24))]  # the indexer's window
    else:
        f += ["--kv-heads", str(kv), "--head-dim", "16"]
    if attn == "gdn":
        f += ["--dim-v", "8", "--chunk-size", str(rng.choice([4, 16])), "--gdn-mode", rng.choice(["chain", "scan"])]
        if rng.random() < 0.4:
            f += ["--conv-width", str(rng.choice([2, 4]))]
        if rng.random() < 0.3:
            c["env"] = {"SEQPAR_GDN_WORK_AHEAD": "0"}
    else:
        shard = rng.choice(["contiguous", "interleave"])
        f += ["--cache-shard", shard]
        if shard == "interleave":
            f += ["--interleave", str(rng.choice([1, 2, 4]))]
    if attn == "mha":
        if rng.random() < 0.6:
            f += ["--chunk", str(rng.randint(1, 24))]
            if rng.random() < 0.9:
                f += ["--chunk-mode", rng.choice(["auto", "pass-kv", "pass-q"])]
        maybe_lowered(rng, c, 0.4)
    c["flags"] = f
    return c


# A flat profile for sp_plan --dynamic-cp (round numbers, measured nowhere): the plans only have to be valid.
FLAT_PROFILE = {"name": "flat", "kernels": {k: {"points": [[1, 1e9]], "source": "random_configs.py: flat"}
                                            for k in ("mha_fwd", "mha_bwd")},
                "links": {l: {"latency_s": 1e-4, "bandwidth_bytes_per_s": 1e8, "source": "random_configs.py: flat"}
                          for l in ("intra", "inter")}}


def dyncp_config(rng, work):
    """Dynamic CP: an sp_plan --dynamic-cp plan over 2 to 8 random documents on 2, 4 or 8 ranks, which dyncp_bench
    must run (it checks no values), then the largest micro-batch of the plan's "dynamic" on a ring of its degree
    under sp_bench --check-against reference (the packed row dyncp_bench runs there)."""
    world = rng.choice([2, 2, 4, 8])
    lens = [rng.choice([1, rng.randint(1, 16), rng.randint(16, 160)]) for _ in range(rng.randint(2, 8))]
    hd = rng.choice([8, 16])
    problem = ["--attn", "mha", "--heads", str(rng.choice([1, 2])), "--head-dim", str(hd), "--causal",
               "--dtype", rng.choice(["fp32", "fp64", "bf16"])]
    plan = ["--world", str(world), "--dynamic-cp", "--doc-lens", ",".join(map(str, lens)),
            "--mb-layout", rng.choice(["contiguous", "zigzag", "stripe", "balanced"])]
    if rng.random() < 0.5:
        plan += ["--tokens-per-rank", str(rng.randint(max(lens), max(lens) + 64))]
    c = Config(np=world, ulysses=1, ring=world, attn="dyncp", doc_lens=lens, plan=plan, problem=problem)
    c["flags"] = plan + ["--"] + problem
    return c


def write_npy(path, shape, values):
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': %s, }" % (tuple(shape),)
    header += " " * (-(10 + len(header) + 1) % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1"))
        f.write(struct.pack("<%df" % len(values), *values))


def write_dsa_tied_inputs(d, rng, seq, heads, hd, dv, ih, idim):
    os.makedirs(d)

    def uniform(*shape):
        n = 1
        for s in shape:
            n *= s
        return [rng.uniform(-1, 1) for _ in range(n)]

    two = [uniform(idim), uniform(idim)]
    k_idx = [x for t in range(seq) for x in two[rng.randint(0, 1)]]
    write_npy(os.path.join(d, "q.npy"), [1, seq, heads, hd], uniform(seq, heads, hd))
    write_npy(os.path.join(d, "c.npy"), [1, seq, hd], uniform(seq, hd))
    write_npy(os.path.join(d, "q_idx.npy"), [1, seq, ih, idim], uniform(seq, ih, idim))
    write_npy(os.path.join(d, "k_idx.npy"), [1, seq, idim], k_idx)
    write_npy(os.path.join(d, "w.npy"), [1, seq, ih], uniform(seq, ih))
    write_npy(os.path.join(d, "dout.npy"), [1, seq, heads, dv], uniform(seq, heads, dv))


def generate(rng, count, inputs_dir):
    """count configurations, the kinds in turn: of every 10, 2 MHA, 2 DSA, 2 GDN, 3 decode (a kind drawn each
    time), 1 dynamic CP."""
    makers = [mha_config, dsa_config, gdn_config, decode_config, mha_config, dyncp_config, dsa_config, gdn_config,
              decode_config, decode_config]
    out = []
    for i in range(count):
        m = makers[i % len(makers)]
        out.append(m(rng, inputs_dir) if m in (dsa_config, dyncp_config) else m(rng))
    return out


# Invalid configurations: each must stop every rank with exit status 1 and the same error line, matching `want`.
INVALID = [
    (2, ["--ring-size", "3"], r"--dp-size 1 x --ulysses-size 1 x --ring-size 3"),
    (2, ["--ring-size", "2", "--window", "8"], r"--window 8.*--causal"),
    (2, ["--ring-size", "2", "--heads", "3", "--kv-heads", "2"], r"--heads 3"),
    (2, ["--ulysses-size", "2", "--heads", "3"], r"--heads 3 must be divisible by --ulysses-size 2"),
    (3, ["--ring-size", "3", "--dropout", "1"], r"--dropout"),
    (2, ["--ring-size", "2", "--attn", "gdn", "--layout", "stripe"], r"--layout stripe"),
    (2, ["--ring-size", "2", "--attn", "gdn", "--rope", "rotate-half"], r"--rope needs --attn dsa or --attn mha"),
    (2, ["--ring-size", "2", "--doc-lens", "3,4", "--batch", "2"], r"--batch 2"),
    (2, ["--ring-size", "2", "--mode", "decode", "--doc-lens", "3,4"], r"--doc-lens needs --mode train"),
    (4, ["--ring-size", "2", "--ulysses-size", "2", "--dtype", "int8"], r"--dtype int8"),
]

SMALL = ["--quiet", "--warmup", "0", "--iters", "1"]


def command(a, np_, flags, program=None):
    """mpiexec -n np sp_bench SMALL flags, or another MPI program (dyncp_bench) with only its flags."""
    prog = [a.sp_bench] + SMALL if program is None else [program]
    return [a.mpiexec, a.np_flag, str(np_)] + a.mpiexec_preflags + prog + flags


def show(a, np_, flags, env=None, program="sp_bench"):
    words = ["%s=%s" % (k, shlex.quote(v)) for k, v in sorted((env or {}).items())]
    words += [shlex.quote(x) for x in [os.path.basename(a.mpiexec), a.np_flag, str(np_), program] + flags]
    return " ".join(words)


def run_argv(a, argv, env=None):
    """(exit status or None on a hang, stdout, stderr, seconds) of argv with env added to this environment. The run
    has its own process group, which a hang kills whole (mpirun and every rank)."""
    t0 = time.time()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env=dict(os.environ, **(env or {})))
    try:
        out, err = p.communicate(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return None, out, err, time.time() - t0
    return p.returncode, out, err, time.time() - t0


def run(a, np_, flags, env=None):
    return run_argv(a, command(a, np_, flags), env)


def judge_valid(rc, out, err):
    """'' when the run passed its check, else the kind of failure and the lines that show it."""
    if rc is None:
        return "hang (no exit within the timeout)"
    errors = [l for l in err.splitlines() if re.match(r"rank \d+: error:", l)]
    if rc == 0 and "# check passed" in out:
        return ""
    if rc == 0:
        return "no '# check passed' line"
    if "check failed" in err or "# check FAILED" in out:
        table = [l for l in out.splitlines() if "FAIL" in l or re.match(r"#\s+tensor", l)]
        return "wrong answer:\n      " + "\n      ".join(table[-20:])
    if errors:
        return "refused (a valid configuration must run): " + errors[0]
    return "crash (exit status %s):\n      %s" % (rc, "\n      ".join((err.strip().splitlines() or ["(no stderr)"])[-6:]))


def judge_invalid(np_, rc, out, err, want):
    if rc is None:
        return "hang"
    if rc != 1:
        return "exit status %s (want 1)" % rc
    lines = [l for l in err.splitlines() if re.match(r"rank \d+: error:", l)]
    ranks = sorted(int(re.match(r"rank (\d+):", l).group(1)) for l in lines)
    if ranks != list(range(np_)):
        return "error lines from ranks %s (want one from each of 0..%d):\n      %s" % (ranks, np_ - 1,
                                                                                  "\n      ".join(lines))
    texts = {re.sub(r"^rank \d+: ", "", l) for l in lines}
    if len(texts) != 1:
        return "the ranks' error lines differ:\n      " + "\n      ".join(lines)
    if not re.search(want, lines[0]):
        return "error line %r does not match %r" % (lines[0], want)
    return ""


# Flags that define the configuration's kind and grid (with the check flags): never dropped when shrinking.
KEEP = {"--attn", "--mode", "--ulysses-size", "--ring-size", "--check", "--check-against", "--inputs"}


def groups_of(flags):
    """The flags as [flag] or [flag, value] groups."""
    out, i = [], 0
    while i < len(flags):
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            out.append(flags[i:i + 2])
            i += 2
        else:
            out.append(flags[i:i + 1])
            i += 1
    return out


def shrink(a, np_, flags, why, budget=24, env=None):
    """A shorter command line that fails the same way (the first word of judge_valid's verdict): drops one flag
    group at a time while the failure stays, at most `budget` runs (the environment kept)."""
    kind = why.split()[0]
    groups = groups_of(flags)
    i = 0
    while i < len(groups) and budget > 0:
        if groups[i][0] in KEEP:
            i += 1
            continue
        trial = [x for g in groups[:i] + groups[i + 1:] for x in g]
        budget -= 1
        rc, out, err, _ = run(a, np_, trial, env)
        verdict = judge_valid(rc, out, err)
        if verdict and verdict.split()[0] == kind:
            groups = groups[:i] + groups[i + 1:]
        else:
            i += 1
    return [x for g in groups for x in g]


def run_dyncp(a, i, c, work):
    """A dynamic-CP configuration's two runs: [(verdict, command shown)]. First sp_plan --dynamic-cp (it must plan)
    and dyncp_bench on its JSON (the dynamic and mixed plans, one round: it must end with status 0 and its per-round
    line); then the largest micro-batch of the dynamic plan, a packed row on a ring of its degree with the plan's
    layout and impl, under sp_bench --check-against reference."""
    plan_json = os.path.join(work, "dyncp_%d.json" % i)
    prof = os.path.join(work, "flat_profile.json")
    if not os.path.exists(prof):
        with open(prof, "w") as f:
            json.dump(FLAT_PROFILE, f)
    plan_argv = [a.sp_plan, "--profile", prof, "--json", plan_json] + c["plan"] + ["--"] + c["problem"]
    shown = " ".join(shlex.quote(x) for x in ["sp_plan", "--profile", prof, "--json", plan_json] + c["plan"] + ["--"] +
                     c["problem"])
    rc, out, err, _ = run_argv(a, plan_argv)
    if rc != 0:
        return [("sp_plan --dynamic-cp refused or failed (exit status %s):\n      %s" % (
            rc, "\n      ".join((out + err).strip().splitlines()[-6:])), shown)]
    bench = ["--plan", plan_json, "--run", "dynamic,mixed", "--rounds", "1"]
    rc, out, err, _ = run_argv(a, command(a, c["np"], bench, a.dyncp_bench))
    shown_bench = shown + " && " + show(a, c["np"], bench, program="dyncp_bench")
    why = ""
    if rc is None:
        why = "hang (no exit within the timeout)"
    elif rc != 0 or "per round:" not in out:
        why = "crash (exit status %s, per-round line %s):\n      %s" % (
            rc, "present" if "per round:" in out else "absent", "\n      ".join((err.strip().splitlines() or
                                                                                 ["(no stderr)"])[-6:]))
    verdicts = [(why, shown_bench)]
    with open(plan_json) as f:
        plan = json.load(f)
    mb = max(plan["dynamic"]["micro_batches"], key=lambda m: (m["tokens"], m["degree"]))
    d = mb["degree"]
    flags = (["--ring-size", str(d), "--layout", plan["input"]["layout"], "--impl", plan["input"]["impl"],
              "--doc-lens", ",".join(map(str, mb["doc_lens"]))] + c["problem"] + ["--check-against", "reference"])
    rc, out, err, _ = run(a, d, flags)
    verdicts.append((judge_valid(rc, out, err), show(a, d, flags)))
    return verdicts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mpiexec", required=True)
    ap.add_argument("--np-flag", default="-n")
    ap.add_argument("--mpiexec-preflags", default="", help="flags before the program, e.g. --oversubscribe")
    ap.add_argument("--sp-bench", required=True)
    ap.add_argument("--seed", type=int, default=None, help="default: SEQPAR_RANDOM_SEED, else a fresh one")
    ap.add_argument("--count", type=int, default=32, help="valid configurations")
    ap.add_argument("--timeout", type=float, default=60, help="seconds per run")
    ap.add_argument("--only", type=int, default=None, help="run only configuration number N (as printed)")
    ap.add_argument("--no-shrink", action="store_true", help="do not look for a shorter failing command line")
    ap.add_argument("--include-known-bugs", action="store_true", help="run the configurations KNOWN_BUGS skips")
    ap.add_argument("--sp-plan", default=None, help="sp_plan (default: beside sp_bench)")
    ap.add_argument("--dyncp-bench", default=None, help="dyncp_bench (default: beside sp_bench)")
    a = ap.parse_args()
    here = os.path.dirname(os.path.abspath(a.sp_bench))
    a.sp_plan = a.sp_plan or os.path.join(here, "sp_plan")
    a.dyncp_bench = a.dyncp_bench or os.path.join(here, "dyncp_bench")
    have_dyncp = os.access(a.sp_plan, os.X_OK) and os.access(a.dyncp_bench, os.X_OK)
    a.mpiexec_preflags = shlex.split(a.mpiexec_preflags)
    env_seed = os.environ.get("SEQPAR_RANDOM_SEED", "")
    seed = a.seed if a.seed is not None else int(env_seed) if env_seed else random.SystemRandom().randrange(1 << 31)
    print("random_configs: seed %d (reproduce: SEQPAR_RANDOM_SEED=%d ctest -R random_configs --output-on-failure, "
          "or %s --seed %d)" % (seed, seed, " ".join(shlex.quote(x) for x in sys.argv[:1] + [
              "--mpiexec", a.mpiexec, "--sp-bench", a.sp_bench]), seed), flush=True)
    rng = random.Random(seed)
    work = tempfile.mkdtemp(prefix="random_configs.")
    configs = generate(rng, a.count, work)
    passed = failed = skipped = 0
    shrink_budget = 48  # shrinking runs in all (each failing configuration is shrunk once)
    t_start = time.time()
    for i, c in enumerate(configs):
        if a.only is not None and i != a.only:
            continue
        bug = None if a.include_known_bugs else next((reason for reason, pred in KNOWN_BUGS if pred(c)), None)
        if bug:
            skipped += 1
            print("[%2d] skipped (known bug: %s): %s" % (i, bug, show(a, c["np"], c.argv(), c.env())), flush=True)
            continue
        if c["attn"] == "dyncp":
            if not have_dyncp:
                skipped += 1
                print("[%2d] skipped (no sp_plan or dyncp_bench beside sp_bench)" % i, flush=True)
                continue
            t0 = time.time()
            for why, shown in run_dyncp(a, i, c, work):
                if why:
                    failed += 1
                    print("[%2d] FAILED %s\n    reproduce: %s" % (i, why, shown), flush=True)
                else:
                    passed += 1
                    print("[%2d] ok %5.1f s  %s" % (i, time.time() - t0, shown), flush=True)
            continue
        shrunk = False
        for check in (["--check"], ["--check-against", "reference"]):
            flags = c.argv() + check
            rc, out, err, dt = run(a, c["np"], flags, c.env())
            why = judge_valid(rc, out, err)
            if why:
                failed += 1
                print("[%2d] FAILED %s\n    reproduce: %s" % (i, why, show(a, c["np"], flags, c.env())), flush=True)
                if not a.no_shrink and not shrunk and shrink_budget > 0:
                    budget = min(24, shrink_budget)
                    shrink_budget -= budget
                    shrunk = True
                    print("    minimal:   %s" % show(a, c["np"], shrink(a, c["np"], flags, why, budget, c.env()),
                                                     c.env()), flush=True)
            else:
                passed += 1
                print("[%2d] ok %5.1f s  %s" % (i, dt, show(a, c["np"], flags, c.env())), flush=True)
    if a.only is None:
        for j, (np_, flags, want) in enumerate(INVALID):
            rc, out, err, dt = run(a, np_, flags)
            why = judge_invalid(np_, rc, out, err, want)
            if why:
                failed += 1
                print("[invalid %d] FAILED %s\n    reproduce: %s" % (j, why, show(a, np_, flags)), flush=True)
            else:
                passed += 1
                print("[invalid %d] ok (one error line per rank, exit 1)  %s" % (j, show(a, np_, flags)), flush=True)
    print("random_configs: seed %d: %d passed, %d failed, %d skipped (known bugs) in %.0f s" %
          (seed, passed, failed, skipped, time.time() - t_start))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
