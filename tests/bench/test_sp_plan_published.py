#!/usr/bin/env python3
"""scripts/sp_plan_published.py --quick runs and its rows hold together: every (mask, phase, CP, method) of
MagiAttention's benchmark at CP 8 and 16 has a prediction; no predicted TFLOPS/s per GPU exceeds the H100 profile's
own attention curve (forward 648, backward 561: a prediction above the kernel's rate would mean FLOPs counted twice
or time lost); the published figures are the ones in benchmarks/published/magiattention_h100.json; the error column
is predicted / published - 1; usp at CP 8 is Ulysses' grid plus its ring function's copies (the profile's
ring.copy_passes, sp_plan --ring-function-at-one): below Ulysses on every mask, and on the full and causal masks
by exactly those bytes at the memory bandwidth (ring_copy_pass_bytes written out below);
ring p2p is the slowest method, published and predicted, on the full and causal masks at CP 8 and 16; the varlen
causal rows average the benchmark's 20 packs (magi_packs), and magi_packs agrees with the benchmark's sequential
packing loop (written out here) on a small distribution.

  test_sp_plan_published.py SP_PLAN
"""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sequential_packs(bins, pack_len, seed, chunk_ratio, count):
    """The benchmark's DatasetSampler.pack_with_shuffle (SandAI-org/MagiAttention exps/dist_attn/benchmark/utils.py),
    step by step: samples (chunks, then tails) shuffled, packed in order, a sample that does not fit split and its
    rest opening the next pack, the packs shuffled; the first `count`."""
    import numpy as np
    rng = np.random.default_rng(seed)
    chunk = pack_len * chunk_ratio
    lengths = np.array([(lo + hi) // 2 for lo, hi, _ in bins], dtype=np.int64)
    nums = np.array([n for _, _, n in bins], dtype=np.int64)
    full = np.repeat(chunk, int((lengths // chunk * nums).sum())).astype(np.int32)
    tails = lengths % chunk
    samples = np.concatenate([full, np.repeat(tails[tails > 0], nums[tails > 0]).astype(np.int32)])
    rng.shuffle(samples)
    samples = samples.tolist()
    packs, i, carry = [], 0, 0
    for _ in range(sum(samples) // pack_len):
        pack, left = [], pack_len
        if carry > 0:
            pack.append(carry)
            left, carry = left - carry, 0
        while left > 0 and i < len(samples):
            if samples[i] <= left:
                pack.append(samples[i])
                left -= samples[i]
            else:
                pack.append(left)
                carry, left = samples[i] - left, 0
            i += 1
        packs.append(pack)
    rng.shuffle(packs)
    return packs[:count]


def check_packs():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import sp_plan_published
    bins = [[0, 10, 300], [11, 50, 2000], [201, 500, 900], [1025, 2048, 400], [8193, 16384, 60], [65537, 131072, 9]]
    failures = []
    for pack_len in (4096, 65536):
        want = sequential_packs(bins, pack_len, 42, 0.25, 20)
        got = sp_plan_published.magi_packs(bins, pack_len, 42, 0.25, 20)
        if got != want:
            failures.append(f"magi_packs at pack_len {pack_len} differs from the benchmark's sequential packing")
        if any(sum(p) != pack_len or max(p) > pack_len // 4 for p in got):
            failures.append(f"magi_packs at pack_len {pack_len}: a pack not of {pack_len} tokens or a sample above "
                            f"a quarter of it")
    return failures


def main():
    sp_plan = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "published.json")
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "sp_plan_published.py"), "--sp-plan", sp_plan,
                        "--quick", "--json", out], check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            res = json.load(f)
    with open(os.path.join(ROOT, "benchmarks", "published", "magiattention_h100.json")) as f:
        pub = json.load(f)["tflops_per_gpu"]
    with open(os.path.join(ROOT, "benchmarks", "profiles", "h100_sxm.json")) as f:
        prof = json.load(f)["kernels"]
    cap = {"fwd": max(p[1] for p in prof["mha_fwd"]["points"]) / 1e12,
           "bwd": max(p[1] for p in prof["mha_bwd"]["points"]) / 1e12}
    rows = res["magiattention"]
    failures = []
    keys = {(r["mask"], r["phase"], r["cp"], r["method"]) for r in rows}
    for mask in ("full", "causal", "varlen_causal"):
        for phase in ("fwd", "bwd"):
            for cp in (8, 16):
                for m in ("ulysses", "ring_p2p", "ring_allgather", "usp"):
                    if (mask, phase, cp, m) not in keys:
                        failures.append(f"no row for {mask} {phase} CP {cp} {m}")
    for r in rows:
        name = f"{r['mask']} {r['phase']} CP {r['cp']} {r['method']}"
        if not 0 < r["predicted_tflops"] <= cap[r["phase"]] * (1 + 1e-9):
            failures.append(f"{name}: predicted {r['predicted_tflops']} TFLOPS/s outside (0, {cap[r['phase']]}]")
        if r["published_tflops"] != pub[f"{r['mask']}/{r['phase']}"][r["method"]][str(r["cp"])]:
            failures.append(f"{name}: published {r['published_tflops']} is not the data file's")
        if abs(r["error"] - (r["predicted_tflops"] / r["published_tflops"] - 1)) > 1e-12:
            failures.append(f"{name}: error {r['error']} is not predicted / published - 1")
    # USP at CP 8: Ulysses over the node, then its ring function with a ring of one (usp.py): the copies of
    # ring_copy_pass_bytes over S = 64K rows of Hq' = 8 query heads and Hkv' = 1 key head, bf16 (e = a = 2, lse 4).
    bw = json.load(open(os.path.join(ROOT, "benchmarks", "profiles", "h100_sxm.json")))["device"][
        "memory_bandwidth_bytes_per_s"]
    S, hq, hkv, e, a, l = 8 * 8192, 8, 1, 2, 2, 4
    copy_s = {"fwd": S * (4 * e * hkv * 128 + hq * (128 * (e + 3 * a) + 2 * l)) / bw,
              "bwd": S * 128 * (8 * e * hkv + 2 * a * hq + 4 * a * hkv) / bw}
    for mask in ("full", "causal", "varlen_causal"):
        for phase in ("fwd", "bwd"):
            u, s = (next(r for r in rows if (r["mask"], r["phase"], r["cp"], r["method"]) == (mask, phase, 8, m))
                    for m in ("ulysses", "usp"))
            if not s["predicted_tflops"] < u["predicted_tflops"]:
                failures.append(f"{mask} {phase} CP 8: usp {s['predicted_tflops']} not below ulysses "
                                f"{u['predicted_tflops']} (its ring function's copies)")
            if mask != "varlen_causal":
                area = S * S if mask == "full" else S * (S + 1) / 2
                flops = 4.0 * area * 64 * 128 * (2.5 if phase == "bwd" else 1.0)
                t_u, t_s = (flops / (x["predicted_tflops"] * 1e12 * 8) for x in (u, s))
                if abs((t_s - t_u) - copy_s[phase]) > 1e-6 * t_u:
                    failures.append(f"{mask} {phase} CP 8: usp - ulysses = {t_s - t_u} s, expected the ring "
                                    f"function's copies {copy_s[phase]} s")
    # Published, ring p2p is the slowest method in every cell; the profile's ring block (its transfer waits for the
    # kernel, a merge pass per step) and, inside one node, NCCL's send/receive rate (links.intra's p2p bandwidth) are
    # what make the model agree on full and causal masks.
    for mask in ("full", "causal"):
        for phase in ("fwd", "bwd"):
            for cp in (8, 16):
                cell = [r for r in rows if (r["mask"], r["phase"], r["cp"]) == (mask, phase, cp)]
                for key in ("published_tflops", "predicted_tflops"):
                    low = min(cell, key=lambda r: r[key])
                    if low["method"] != "ring_p2p":
                        failures.append(f"{mask} {phase} CP {cp}: {key} lowest is {low['method']}, not ring_p2p")
    failures += check_packs()
    for r in rows:
        if r["mask"] == "varlen_causal" and (r["packs"] != 20 or len(r["predicted_per_pack"]) != 20):
            failures.append(f"varlen {r['phase']} CP {r['cp']} {r['method']}: {r['packs']} packs, expected 20")
    if len(res["orders"]) != 12:
        failures.append(f"{len(res['orders'])} order cells, expected 12 (3 masks x 2 phases x 2 CP sizes)")
    for f in failures:
        print("FAIL:", f)
    print(f"{len(rows)} rows, {res['within_25pct']} within 25%, {res['cells_same_order']} cells in the same order; "
          f"{len(failures)} failures")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
