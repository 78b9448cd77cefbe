#!/usr/bin/env python3
"""sp_plan's predictions against measured sp_bench times on this machine (docs/results.md, "sp_plan on this machine").

For each case: sp_plan --json ranks the configurations of the problem at its world size with the profile; the case's
configuration is looked up by name; sp_bench runs it under mpirun (--json) and its median fwd+bwd time is compared.
Cases of one problem at one world size form a group: the planner's first choice among the group's measured
configurations is compared with the measured fastest. Prints a markdown table and writes --json.

--repeat N runs every case N times, in rounds (each round runs every case once, so that a slow minute of a shared
machine falls on every configuration of a group alike; odd rounds in reverse order, so that a rising load does not
favour the configuration listed first); a case's measured time is the median of its rounds. The group table then also gives, per round, the first choice against the fastest of that round, and the
run-to-run spread: per configuration (max - min) / median over the rounds, the group's largest.

--baseline-profile FILE also predicts every case with a second profile (e.g. the same calibration without its
"shared_node" block) against the same measurements: the table gains its prediction and error, the summary its median
|error| and first choices, so that two models are compared on one run of a shared machine.

  scripts/sp_plan_check.py --build build --profile build/profile.json --json build/sp_plan_check.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

MHA = ["--attn", "mha", "--heads", "8", "--kv-heads", "8", "--head-dim", "64", "--seq", "2K", "--causal"]
MHA_PACKED = ["--attn", "mha", "--heads", "8", "--kv-heads", "8", "--head-dim", "64", "--doc-lens",
              "1024,512,256,128,64,64", "--causal"]
DSA = ["--attn", "dsa", "--heads", "16", "--head-dim", "128", "--dim-v", "128", "--indexer-heads", "8",
       "--indexer-dim", "64", "--topk", "256", "--seq", "2K"]
DEC = ["--attn", "mha", "--heads", "8", "--kv-heads", "8", "--head-dim", "64", "--context", "8K", "--decode-steps", "16",
       "--prefill", "fill"]
DEC4 = ["--attn", "mha", "--heads", "8", "--kv-heads", "8", "--head-dim", "64", "--context", "16K", "--decode-steps",
        "16", "--new-tokens", "4", "--prefill", "fill"]
GDN = ["--attn", "gdn", "--heads", "8", "--kv-heads", "4", "--head-dim", "64", "--dim-v", "64", "--seq", "4K"]

# (group, world, problem, configuration name as sp_plan prints it)
CASES = [
    ("mha np1", 1, MHA, "u1xr1 zigzag p2p"),
    ("mha np2", 2, MHA, "u1xr2 zigzag p2p"),
    ("mha np2", 2, MHA, "u1xr2 contiguous p2p"),
    ("mha np2", 2, MHA, "u1xr2 zigzag allgather"),
    ("mha np2", 2, MHA, "u1xr2 contiguous allgather"),
    ("mha np2", 2, MHA, "u2xr1 zigzag p2p"),
    ("mha np4 (oversubscribed)", 4, MHA, "u2xr2 zigzag p2p"),
    ("mha np4 (oversubscribed)", 4, MHA, "u1xr4 zigzag p2p"),
    ("mha packed np2", 2, MHA_PACKED, "u1xr2 zigzag p2p"),
    ("mha packed np2", 2, MHA_PACKED, "u1xr2 balanced p2p"),
    ("dsa np1", 1, DSA, "u1xr1 zigzag select-ring"),
    ("dsa np2", 2, DSA, "u1xr2 zigzag select-ring"),
    ("dsa np2", 2, DSA, "u1xr2 zigzag select-allgather"),
    ("gdn np1", 1, GDN, "u1xr1 zigzag scan"),
    ("gdn np2", 2, GDN, "u1xr2 zigzag chain"),
    ("gdn np2", 2, GDN, "u1xr2 zigzag scan"),
    ("gdn np2", 2, GDN, "u1xr2 contiguous chain"),
    ("gdn np4 (oversubscribed)", 4, GDN, "u1xr4 zigzag scan"),
    ("gdn np4 (oversubscribed)", 4, GDN, "u1xr4 zigzag chain"),
    # A decode step (sp_plan --mode decode against sp_bench --mode decode's median step): two problems at 1 and 2 ranks.
    ("decode np1", 1, DEC, "u1xr1 zigzag cache-interleave", "decode"),
    ("decode np2", 2, DEC, "u1xr2 zigzag cache-interleave", "decode"),
    ("decode np2", 2, DEC, "u1xr2 zigzag cache-contiguous", "decode"),
    ("decode n4 np1", 1, DEC4, "u1xr1 zigzag cache-interleave", "decode"),
    ("decode n4 np2", 2, DEC4, "u1xr2 zigzag cache-interleave", "decode"),
    ("decode n4 np2", 2, DEC4, "u1xr2 zigzag cache-contiguous", "decode"),
]


def run(cmd, **kw):
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, **kw).stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--profile", required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--groups", nargs="+", help="run only the cases of groups starting with one of these")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every case; measured = median of the rounds")
    ap.add_argument("--baseline-profile", help="also predict with this profile against the same measurements")
    a = ap.parse_args()
    if a.repeat < 1:
        raise SystemExit(f"--repeat {a.repeat} must be >= 1")
    sp_plan = os.path.join(a.build, "benchmarks", "sp_plan")
    sp_bench = os.path.join(a.build, "benchmarks", "sp_bench")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    plans = {}
    rows = []
    baseline = {}  # (group, configuration): step_s predicted with --baseline-profile
    with tempfile.TemporaryDirectory() as tmp:
        todo = []
        for case in CASES:
            group, world, problem, name = case[:4]
            if a.groups and not any(group.startswith(g) for g in a.groups):
                continue
            mode = case[4] if len(case) > 4 else "train"
            for prof in [a.profile] + ([a.baseline_profile] if a.baseline_profile else []):
                key = (prof, world, tuple(problem), mode)
                if key not in plans:
                    out = os.path.join(tmp, f"plan{len(plans)}.json")
                    run([sp_plan, "--profile", prof, "--world", str(world), "--mode", mode, "--json", out, "--"] +
                        problem, env=env)
                    with open(out) as f:
                        plans[key] = json.load(f)
            plan = plans[(a.profile, world, tuple(problem), mode)]
            ranked = [r for r in plan["ranked"] if r["name"] == name]
            if not ranked:
                excl = [r["reason"] for r in plan["excluded"] if r["name"] == name]
                raise SystemExit(f"{name}: not ranked ({excl})")
            if a.baseline_profile:
                base = plans[(a.baseline_profile, world, tuple(problem), mode)]
                baseline[(group, name)] = next(r for r in base["ranked"] if r["name"] == name)["predicted"]["step_s"]
            todo.append((group, world, problem, name, mode, plan, ranked[0], []))
        for i in range(a.repeat):
            # Odd rounds run the cases in reverse, so that a load that rises or falls through the run does not
            # always favour the configuration a group lists first.
            for group, world, problem, name, mode, plan, r, measured in (todo if i % 2 == 0 else todo[::-1]):
                out = os.path.join(tmp, "bench.json")
                run([a.mpirun, "-np", str(world), "--oversubscribe", sp_bench] + problem + r["sp_bench_flags"] +
                    ["--warmup", "1", "--iters", str(a.iters), "--quiet", "--json", out], env=env)
                with open(out) as f:
                    bench = json.load(f)
                if mode == "decode":
                    measured.append((bench["decode_step_s"]["median"], None))
                else:
                    whole = next(p for p in bench["phases"] if p["phase"] == "fwd+bwd")
                    measured.append((whole["time_ms"] / 1e3, whole["exposed_comm_pct"]))
        for group, world, problem, name, mode, plan, r, measured in todo:
            times = [m[0] for m in measured]
            exposed = [m[1] for m in measured if m[1] is not None]
            predicted = r["predicted"]["step_s"]
            med_t = statistics.median(times)
            rows.append({"group": group, "world": world, "config": name, "predicted_s": predicted,
                         "measured_s": med_t, "measured_rounds_s": times, "error": predicted / med_t - 1,
                         "plan_rank": [x["name"] for x in plan["ranked"]].index(name) + 1,
                         "oversubscribed": r["predicted"]["oversubscribed"],
                         "exposed_comm_s": r["predicted"]["exposed_comm_s"],
                         "measured_exposed_pct": statistics.median(exposed) if exposed else None})
            if a.baseline_profile:
                rows[-1]["baseline_predicted_s"] = baseline[(group, name)]
                rows[-1]["baseline_error"] = baseline[(group, name)] / med_t - 1
    groups = {}
    for row in rows:
        groups.setdefault(row["group"], []).append(row)
    choice = {}
    for g, rs in groups.items():
        if len(rs) < 2:
            continue
        first = min(rs, key=lambda x: x["predicted_s"])
        fastest = min(rs, key=lambda x: x["measured_s"])
        per_round = [first["measured_rounds_s"][i] / min(x["measured_rounds_s"][i] for x in rs) - 1
                     for i in range(a.repeat)]
        spread = max((max(x["measured_rounds_s"]) - min(x["measured_rounds_s"])) / x["measured_s"] for x in rs)
        choice[g] = {"first_choice": first["config"], "measured_fastest": fastest["config"],
                     "first_choice_vs_fastest": first["measured_s"] / fastest["measured_s"] - 1,
                     "first_choice_vs_fastest_per_round": per_round, "spread": spread}
        if a.baseline_profile:
            bfirst = min(rs, key=lambda x: x["baseline_predicted_s"])
            choice[g]["baseline_first_choice"] = bfirst["config"]
            choice[g]["baseline_first_choice_vs_fastest"] = bfirst["measured_s"] / fastest["measured_s"] - 1
    med = statistics.median(abs(r["error"]) for r in rows)
    bmed = statistics.median(abs(r["baseline_error"]) for r in rows) if a.baseline_profile else None
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    result = {"rows": rows, "choice": choice, "median_abs_error": med, "load_after": load}
    if a.baseline_profile:
        result["baseline_profile"] = a.baseline_profile
        result["baseline_median_abs_error"] = bmed
    with open(a.json, "w") as f:
        json.dump(result, f, indent=2)
    if a.baseline_profile:
        print("| group | configuration | predicted (ms) | baseline (ms) | measured (ms) | error | baseline error | "
              "plan rank |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['group']} | {r['config']} | {r['predicted_s'] * 1e3:.1f} | "
                  f"{r['baseline_predicted_s'] * 1e3:.1f} | {r['measured_s'] * 1e3:.1f} | {r['error'] * 100:+.0f}% | "
                  f"{r['baseline_error'] * 100:+.0f}% | {r['plan_rank']} |")
        print(f"\nmedian |error|: {med * 100:.0f}% (baseline {bmed * 100:.0f}%); load average after: {load}\n")
        print("| group | first choice | vs fastest | baseline's first choice | vs fastest |")
        print("|---|---|---:|---|---:|")
        for g, c in choice.items():
            print(f"| {g} | {c['first_choice']} | {c['first_choice_vs_fastest'] * 100:+.0f}% | "
                  f"{c['baseline_first_choice']} | {c['baseline_first_choice_vs_fastest'] * 100:+.0f}% |")
        print()
    else:
        print("| group | configuration | predicted (ms) | measured (ms) | error | plan rank |")
        print("|---|---|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['group']} | {r['config']} | {r['predicted_s'] * 1e3:.1f} | {r['measured_s'] * 1e3:.1f} | "
                  f"{r['error'] * 100:+.0f}% | {r['plan_rank']} |")
        print(f"\nmedian |error|: {med * 100:.0f}%; load average after: {load}\n")
    if a.repeat == 1:
        print("| group | first choice (predicted) | measured fastest | first choice vs fastest |")
        print("|---|---|---|---:|")
        for g, c in choice.items():
            print(f"| {g} | {c['first_choice']} | {c['measured_fastest']} | "
                  f"{c['first_choice_vs_fastest'] * 100:+.0f}% |")
        return
    print(f"medians of {a.repeat} rounds\n")
    print("| group | first choice (predicted) | measured fastest | first choice vs fastest | per round | spread |")
    print("|---|---|---|---:|---|---:|")
    for g, c in choice.items():
        rounds = " / ".join(f"{x * 100:+.0f}" for x in c["first_choice_vs_fastest_per_round"])
        print(f"| {g} | {c['first_choice']} | {c['measured_fastest']} | {c['first_choice_vs_fastest'] * 100:+.0f}% | "
              f"{rounds} % | {c['spread'] * 100:.0f}% |")


if __name__ == "__main__":
    main()
