#!/usr/bin/env python3
"""sp_plan's predictions against published runs at scale (docs/results.md, "sp_plan against published runs").

One profile per device for every case (benchmarks/profiles/h100_sxm.json), nothing tuned per case. The published
figures and where they come from: benchmarks/published/*.json.

  MagiAttention's H100 context-parallel benchmark: 8K tokens per GPU, CP 8 to 64, 8 GPUs a node; Ulysses, ring p2p,
  ring all-gather, USP (Ulysses 8 in a node x ring over the nodes); full, causal and varlen causal masks; forward and
  backward TFLOPS/s per GPU. Predicted: FLOPs / (sp_plan's forward or backward time x CP), with MagiAttention's FLOPs
  formula; varlen causal on the benchmark's own 20 packs (magi_packs; needs numpy, the benchmark's generator), the
  mean of the per-pack figures as the benchmark reports them. Checked: the order of the methods at each CP size, and
  TFLOPS per GPU within 25%.

  Meta's context-parallel inference (Llama3 405B prefill on 16 nodes of 8 H100): 1M tokens in 77 s at 93% parallel
  efficiency, 128K tokens in 3.8 s. Predicted with --mode prefill --layers 126 --linear-flops-per-token (the linear
  layers at the gemm curve) --tp 8, a ring over the 16 nodes. Checked: the efficiency within 5 points.

  scripts/sp_plan_published.py --sp-plan build/benchmarks/sp_plan --json build/published.json > tables.md
  scripts/sp_plan_published.py --sp-plan build/benchmarks/sp_plan --quick     # CP 8 and 16 only (the ctest)
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ["ulysses", "ring_p2p", "ring_allgather", "usp"]
MASKS = ["full", "causal", "varlen_causal"]
HQ, HKV, D, PER_GPU, GPUS_PER_NODE = 64, 8, 128, 8192, 8

# Llama3 405B (benchmarks/published/meta_cp_inference.json): forward FLOPs per token of one layer's linear layers:
# 2 x (Wq + Wk + Wv + Wo + the SwiGLU MLP's three matrices).
L405_LAYERS, L405_DIM, L405_FFN, L405_HQ, L405_HKV, L405_D = 126, 16384, 53248, 128, 8, 128
L405_LINEAR = 2.0 * (L405_DIM * (L405_HQ + 2 * L405_HKV) * L405_D + L405_HQ * L405_D * L405_DIM +
                     3 * L405_DIM * L405_FFN)


def config_of(method, cp):
    return {"ulysses": f"u{cp}xr1 zigzag p2p", "ring_p2p": f"u1xr{cp} zigzag p2p",
            "ring_allgather": f"u1xr{cp} zigzag allgather",
            "usp": f"u{min(cp, GPUS_PER_NODE)}xr{max(1, cp // GPUS_PER_NODE)} zigzag p2p"}[method]


# MagiAttention's USP runs its ring function (FA3RingAttnFunc) whatever the ring size, a ring of one at CP 8 included
# (usp.py apply_attn); Ulysses calls the kernel directly. sp_plan charges the ring function's copy passes
# (profile ring.copy_passes) to a ring of one only with --ring-function-at-one, so USP is planned in its own call.
EXTRA = {"usp": ["--ring-function-at-one"]}


def label_of(method, cp):
    """The configuration and the flags it is planned with: USP at CP 8 is Ulysses' grid plus the ring function."""
    return config_of(method, cp) + (" +ring-function" if method in EXTRA and cp <= GPUS_PER_NODE else "")


def magi_packs(bins, pack_len, seed, chunk_ratio, count):
    """The varlen packs of MagiAttention's benchmark, as its DatasetSampler makes them (SandAI-org/MagiAttention,
    exps/dist_attn/benchmark/utils.py at commit 2c64135; benchmark_conf.py: seed 42, 20 packs, chunk_ratio 0.25):
    every document of a bin [lo, hi] (count documents) is (lo + hi) // 2 tokens long and is cut into chunks of
    pack_len x chunk_ratio tokens and a tail; the chunks, then the tails, shuffled with numpy's default_rng(seed);
    packed in that order into packs of pack_len tokens, a sample that does not fit split at the pack's end (its rest
    opens the next pack), which is the stream of samples cut at every multiple of pack_len; the packs shuffled with
    the same generator; the first `count` taken. Returns the packs' document lengths."""
    import numpy as np  # the benchmark's own generator: its draws are the packs
    rng = np.random.default_rng(seed)
    chunk = pack_len * chunk_ratio
    lengths = np.array([(lo + hi) // 2 for lo, hi, _ in bins], dtype=np.int64)
    nums = np.array([n for _, _, n in bins], dtype=np.int64)
    full = np.repeat(chunk, int((lengths // chunk * nums).sum())).astype(np.int32)
    tails = lengths % chunk
    keep = tails > 0
    samples = np.concatenate([full, np.repeat(tails[keep], nums[keep]).astype(np.int32)])
    rng.shuffle(samples)
    ends = np.cumsum(samples, dtype=np.int64)
    order = list(range(int(ends[-1]) // pack_len))
    rng.shuffle(order)  # a list, as the benchmark's list of packs: the permutation depends only on its length
    packs = []
    for k in order[:count]:
        lo, hi = k * pack_len, (k + 1) * pack_len
        cuts = ends[np.searchsorted(ends, lo, side="right"):np.searchsorted(ends, hi, side="left")]
        packs.append([int(x) for x in np.diff(np.concatenate([[lo], cuts, [hi]]))])
    return packs


def mask_pairs(mask, seq, docs):
    if mask == "full":
        return float(seq) * seq
    if mask == "causal":
        return seq * (seq + 1) / 2.0
    return sum(n * (n + 1) / 2.0 for n in docs)


def run_plan(sp_plan, profile, world, nodes, dpn, configs, problem, extra, tmp):
    out = os.path.join(tmp, "plan.json")
    cmd = [sp_plan, "--profile", profile, "--world", str(world), "--nodes", str(nodes), "--devices-per-node",
           str(dpn), "--json", out, "--configs", ",".join(configs)] + extra + ["--"] + problem
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        plan = json.load(f)
    if plan["excluded"]:
        sys.exit(f"sp_plan_published: excluded: {[(x['name'], x['reason']) for x in plan['excluded']]}")
    return {r["name"]: r["predicted"] for r in plan["ranked"]}


def magi(sp_plan, profile, published, cps, tmp):
    """Per (mask, phase, CP, method): the predicted TFLOPS/s per GPU as the benchmark reports it (run_benchmark.py):
    per pack the mask's FLOPs / (time x CP), then the mean over the packs (one pack, the whole row, for full and
    causal; the benchmark's 20 varlen packs, magi_packs, for varlen causal)."""
    rows = []
    vp = published["varlen_packing"]
    for mask in MASKS:
        for cp in cps:
            seq = cp * PER_GPU
            packs = (magi_packs(published["doc_length_bins"], seq, vp["seed"], vp["chunk_ratio"], vp["packs"])
                     if mask == "varlen_causal" else [[]])
            tflops = {(phase, m): [] for phase in ("fwd", "bwd") for m in METHODS}
            for docs in packs:
                problem = ["--attn", "mha", "--heads", str(HQ), "--kv-heads", str(HKV), "--head-dim", str(D),
                           "--dtype", "bf16"]
                problem += ["--doc-lens", ",".join(map(str, docs))] if docs else ["--seq", str(seq)]
                if mask != "full":
                    problem.append("--causal")
                pred = {}
                for extra in ([], *EXTRA.values()):
                    ms = [m for m in METHODS if EXTRA.get(m, []) == extra]
                    got = run_plan(sp_plan, profile, cp, max(1, cp // GPUS_PER_NODE), min(cp, GPUS_PER_NODE),
                                   sorted({config_of(m, cp) for m in ms}), problem, extra, tmp)
                    pred.update({m: got[config_of(m, cp)] for m in ms})
                fwd_flops = 4.0 * mask_pairs(mask, seq, docs) * HQ * D
                for phase, flops in (("fwd", fwd_flops), ("bwd", 2.5 * fwd_flops)):
                    for m in METHODS:
                        p = pred[m]
                        t = p["forward_s"] if phase == "fwd" else p["backward_s"]
                        tflops[(phase, m)].append(flops / (t * cp) / 1e12)
            for phase in ("fwd", "bwd"):
                pub = published["tflops_per_gpu"][f"{mask}/{phase}"]
                for m in METHODS:
                    per_pack = tflops[(phase, m)]
                    predicted = sum(per_pack) / len(per_pack)
                    rows.append({"mask": mask, "phase": phase, "cp": cp, "method": m, "config": label_of(m, cp),
                                 "published_tflops": pub[m][str(cp)], "predicted_tflops": predicted,
                                 "error": predicted / pub[m][str(cp)] - 1,
                                 "packs": len(packs) if packs[0] else 0,
                                 "docs": sum(len(d) for d in packs) if packs[0] else 0,
                                 "predicted_per_pack": per_pack if packs[0] else []})
    return rows


def published_spread(rows):
    """Per (mask, phase): the published figures' own spread, |ulysses - usp| / the larger at CP 8, where both methods
    run one grid (Ulysses over the 8 GPUs of the node; USP adds only its ring function's copies, ring.copy_passes):
    an upper bound on what two measurements of the same thing differ by."""
    out = {}
    for r in rows:
        if r["cp"] == 8 and r["method"] == "ulysses":
            u = r["published_tflops"]
            s = next(x["published_tflops"] for x in rows
                     if (x["mask"], x["phase"], x["cp"], x["method"]) == (r["mask"], r["phase"], 8, "usp"))
            out[(r["mask"], r["phase"])] = abs(u - s) / max(u, s)
    return out


def order_agreement(rows):
    """Per (mask, phase, cp): the methods ordered by published and by predicted TFLOPS, and the pairs ordered alike
    (ties within 1% of the published figure count as either order); also the pairs whose published gap exceeds the
    published spread of (mask, phase) (published_spread), and how many of those are ordered alike."""
    spread = published_spread(rows) if any(r["cp"] == 8 for r in rows) else {}
    cells = {}
    for r in rows:
        cells.setdefault((r["mask"], r["phase"], r["cp"]), []).append(r)
    out = []
    for key, rs in cells.items():
        agree = total = clear = clear_agree = 0
        for i in range(len(rs)):
            for j in range(i + 1, len(rs)):
                a, b = rs[i], rs[j]
                if a["config"] == b["config"]:
                    continue  # one configuration planned twice (none now: USP at CP 8 carries its ring function)
                total += 1
                dp = a["published_tflops"] - b["published_tflops"]
                dq = a["predicted_tflops"] - b["predicted_tflops"]
                top = max(a["published_tflops"], b["published_tflops"])
                if abs(dp) <= 0.01 * top or dp * dq > 0:
                    agree += 1
                if abs(dp) > spread.get(key[:2], 0.01) * top:
                    clear += 1
                    clear_agree += dp * dq > 0
        pub_order = [r["method"] for r in sorted(rs, key=lambda r: -r["published_tflops"])]
        pred_order = [r["method"] for r in sorted(rs, key=lambda r: -r["predicted_tflops"])]
        out.append({"mask": key[0], "phase": key[1], "cp": key[2], "published_order": pub_order,
                    "predicted_order": pred_order, "pairs_agree": agree, "pairs": total,
                    "same_order": agree == total, "clear_pairs": clear, "clear_pairs_agree": clear_agree,
                    "published_spread": spread.get(key[:2])})
    return out


def meta(sp_plan, profile, tmp):
    problem = ["--attn", "mha", "--heads", str(L405_HQ), "--kv-heads", str(L405_HKV), "--head-dim", str(L405_D),
               "--causal", "--dtype", "bf16"]
    extra = ["--mode", "prefill", "--layers", str(L405_LAYERS), "--linear-flops-per-token", f"{L405_LINEAR:.6g}",
             "--tp", "8"]
    res = {}
    for name, seq, nodes in (("1m_16", "1M", 16), ("1m_1", "1M", 1), ("128k_16", "128K", 16)):
        cfg = f"u1xr{nodes} zigzag p2p"
        res[name] = run_plan(sp_plan, profile, nodes, nodes, 1, [cfg], problem + ["--seq", seq], extra, tmp)[cfg]
    eff = res["1m_1"]["step_s"] / (16 * res["1m_16"]["step_s"])
    s = 1 << 20
    flops = L405_LAYERS * (L405_LINEAR * s + 4.0 * s * (s + 1) / 2 * L405_HQ * L405_D)
    return {"predicted_1m_s": res["1m_16"]["step_s"], "predicted_128k_s": res["128k_16"]["step_s"],
            "predicted_1m_one_node_s": res["1m_1"]["step_s"], "predicted_efficiency": eff,
            "exposed_comm_1m_s": res["1m_16"]["exposed_comm_s"], "linear_1m_s": res["1m_16"]["linear_s"],
            "model_flops_1m": flops, "achieved_flops_per_gpu_1m": flops / (res["1m_16"]["step_s"] * 128)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sp-plan", default=os.path.join("build", "benchmarks", "sp_plan"))
    ap.add_argument("--profile", default=os.path.join(ROOT, "benchmarks", "profiles", "h100_sxm.json"))
    ap.add_argument("--published", default=os.path.join(ROOT, "benchmarks", "published"))
    ap.add_argument("--quick", action="store_true", help="CP 8 and 16 only, and no Llama3 405B")
    ap.add_argument("--json", help="also write the rows as JSON")
    a = ap.parse_args()
    with open(os.path.join(a.published, "magiattention_h100.json")) as f:
        magi_pub = json.load(f)
    with open(os.path.join(a.published, "meta_cp_inference.json")) as f:
        meta_pub = json.load(f)
    cps = [8, 16] if a.quick else [8, 16, 32, 64]
    with tempfile.TemporaryDirectory() as tmp:
        rows = magi(a.sp_plan, a.profile, magi_pub, cps, tmp)
        orders = order_agreement(rows)
        meta_res = None if a.quick else meta(a.sp_plan, a.profile, tmp)
    within = sum(abs(r["error"]) <= 0.25 for r in rows)
    same = sum(o["same_order"] for o in orders)
    print("MagiAttention H100, 8K tokens per GPU: TFLOPS/s per GPU, published / predicted (error)\n")
    for mask in MASKS:
        for phase in ("fwd", "bwd"):
            print(f"| {mask} {phase} | " + " | ".join(f"CP {cp}" for cp in cps) + " |")
            print("|---|" + "---:|" * len(cps))
            for m in METHODS:
                cells = []
                for cp in cps:
                    r = next(x for x in rows if (x["mask"], x["phase"], x["cp"], x["method"]) == (mask, phase, cp, m))
                    cells.append(f"{r['published_tflops']:.0f} / {r['predicted_tflops']:.0f} ({r['error'] * 100:+.0f}%)")
                print(f"| {m} | " + " | ".join(cells) + " |")
            print()
    print("| mask | phase | CP | published order | predicted order | pairs ordered alike | beyond the spread |")
    print("|---|---|---:|---|---|---:|---:|")
    for o in orders:
        print(f"| {o['mask']} | {o['phase']} | {o['cp']} | {' > '.join(o['published_order'])} | "
              f"{' > '.join(o['predicted_order'])} | {o['pairs_agree']} / {o['pairs']} | "
              f"{o['clear_pairs_agree']} / {o['clear_pairs']} |")
    clear = sum(o["clear_pairs"] for o in orders)
    clear_agree = sum(o["clear_pairs_agree"] for o in orders)
    pairs = sum(o["pairs"] for o in orders)
    pairs_agree = sum(o["pairs_agree"] for o in orders)
    print(f"\nwithin 25%: {within} of {len(rows)}; the same order of methods: {same} of {len(orders)} cells; "
          f"pairs ordered alike: {pairs_agree} of {pairs}; of the {clear} pairs whose published gap exceeds the "
          f"published spread of their mask and phase, {clear_agree} ordered alike")
    if meta_res:
        pub = meta_pub["published"]
        print("\nLlama3 405B prefill, 16 nodes x 8 H100 (CP 16 x TP 8): published / predicted\n")
        print("| figure | published | predicted |")
        print("|---|---:|---:|")
        print(f"| 1M-token prefill (s) | {pub['prefill_1m_s']} | {meta_res['predicted_1m_s']:.1f} |")
        print(f"| 128K-token prefill (s) | {pub['prefill_128k_s']} | {meta_res['predicted_128k_s']:.2f} |")
        print(f"| parallel efficiency at 1M | {pub['parallel_efficiency_1m'] * 100:.0f}% | "
              f"{meta_res['predicted_efficiency'] * 100:.1f}% |")
        print(f"| model FLOP/s per GPU at 1M (TFLOP/s) | - | {meta_res['achieved_flops_per_gpu_1m'] / 1e12:.0f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"magiattention": rows, "orders": orders, "within_25pct": within, "cells_same_order": same,
                       "pairs": pairs, "pairs_agree": pairs_agree, "clear_pairs": clear,
                       "clear_pairs_agree": clear_agree,
                       "meta": meta_res, "profile": a.profile}, f, indent=1)


if __name__ == "__main__":
    main()
