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

--calibrate-each-round (with --repeat N) runs `sp_plan --calibrate` before every round instead of reading --profile,
and predicts that round's cases from that round's profile (kept as JSON.roundK.profile.json): a case's error is the
median over the rounds of each round's prediction against the same round's measurement, its predicted time the
median of the rounds' predictions (which also decides the first choice). On a shared or virtual machine whose speed
drifts over minutes, this keeps the drift between a calibration and a later check out of the comparison.

  scripts/sp_plan_check.py --build build --profile build/profile.json --json build/sp_plan_check.json
  scripts/sp_plan_check.py --build build --calibrate-each-round --repeat 5 --json build/sp_plan_check.json
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
    ap.add_argument("--profile", help="the profile to predict with (required unless --calibrate-each-round)")
    ap.add_argument("--json", required=True)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--groups", nargs="+", help="run only the cases of groups starting with one of these")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every case; measured = median of the rounds")
    ap.add_argument("--baseline-profile", help="also predict with this profile against the same measurements")
    ap.add_argument("--calibrate-each-round", action="store_true",
                    help="run sp_plan --calibrate before every round and predict the round from it")
    a = ap.parse_args()
    if a.repeat < 1:
        raise SystemExit(f"--repeat {a.repeat} must be >= 1")
    if a.calibrate_each_round and (a.profile or a.baseline_profile):
        raise SystemExit("--calibrate-each-round makes its own profiles: leave out --profile and --baseline-profile")
    if not a.calibrate_each_round and not a.profile:
        raise SystemExit("--profile is required (or --calibrate-each-round)")
    sp_plan = os.path.join(a.build, "benchmarks", "sp_plan")
    sp_bench = os.path.join(a.build, "benchmarks", "sp_bench")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        plans = {}

        def plan_cases(profile, baseline_profile=None):
            """The cases to run, each with its plan and ranked row under profile (and baseline_profile's step)."""
            todo = []
            for case in CASES:
                group, world, problem, name = case[:4]
                if a.groups and not any(group.startswith(g) for g in a.groups):
                    continue
                mode = case[4] if len(case) > 4 else "train"
                for prof in [profile] + ([baseline_profile] if baseline_profile else []):
                    key = (prof, world, tuple(problem), mode)
                    if key not in plans:
                        out = os.path.join(tmp, f"plan{len(plans)}.json")
                        run([sp_plan, "--profile", prof, "--world", str(world), "--mode", mode, "--json", out,
                             "--"] + problem, env=env)
                        with open(out) as f:
                            plans[key] = json.load(f)
                plan = plans[(profile, world, tuple(problem), mode)]
                ranked = [r for r in plan["ranked"] if r["name"] == name]
                if not ranked:
                    excl = [r["reason"] for r in plan["excluded"] if r["name"] == name]
                    raise SystemExit(f"{name}: not ranked ({excl})")
                base = None
                if baseline_profile:
                    bplan = plans[(baseline_profile, world, tuple(problem), mode)]
                    base = next(r for r in bplan["ranked"] if r["name"] == name)["predicted"]["step_s"]
                todo.append((group, world, problem, name, mode, plan, ranked[0], base))
            return todo

        def measure(world, problem, r, mode):
            """(seconds, exposed communication %) of one sp_bench run of the case."""
            out = os.path.join(tmp, "bench.json")
            run([a.mpirun, "-np", str(world), "--oversubscribe", sp_bench] + problem + r["sp_bench_flags"] +
                ["--warmup", "1", "--iters", str(a.iters), "--quiet", "--json", out], env=env)
            with open(out) as f:
                bench = json.load(f)
            if mode == "decode":
                return bench["decode_step_s"]["median"], None
            whole = next(p for p in bench["phases"] if p["phase"] == "fwd+bwd")
            return whole["time_ms"] / 1e3, whole["exposed_comm_pct"]

        # per case, in CASES order: (todo entry of the first round, [(predicted, measured, exposed) per round])
        cases = []
        for i in range(a.repeat):
            profile = a.profile
            if a.calibrate_each_round:
                profile = f"{a.json}.round{i + 1}.profile.json"
                run([sp_plan, "--calibrate", profile], env=env)
            todo = plan_cases(profile, a.baseline_profile)
            if not cases:
                cases = [(t, []) for t in todo]
            # Odd rounds run the cases in reverse, so that a load that rises or falls through the run does not
            # always favour the configuration a group lists first.
            order = list(range(len(todo))) if i % 2 == 0 else list(range(len(todo)))[::-1]
            for k in order:
                group, world, problem, name, mode, plan, r, base = todo[k]
                t, exposed = measure(world, problem, r, mode)
                cases[k][1].append((r["predicted"]["step_s"], t, exposed))
        for (group, world, problem, name, mode, plan, r, base), rounds in cases:
            times = [m[1] for m in rounds]
            exposed = [m[2] for m in rounds if m[2] is not None]
            med_t = statistics.median(times)
            if a.calibrate_each_round:
                predicted = statistics.median(m[0] for m in rounds)
                error = statistics.median(m[0] / m[1] - 1 for m in rounds)
            else:
                predicted = r["predicted"]["step_s"]
                error = predicted / med_t - 1
            rows.append({"group": group, "world": world, "config": name, "predicted_s": predicted,
                         "measured_s": med_t, "measured_rounds_s": times, "error": error,
                         "plan_rank": [x["name"] for x in plan["ranked"]].index(name) + 1,
                         "oversubscribed": r["predicted"]["oversubscribed"],
                         "exposed_comm_s": r["predicted"]["exposed_comm_s"],
                         "measured_exposed_pct": statistics.median(exposed) if exposed else None})
            if a.calibrate_each_round:
                rows[-1]["predicted_rounds_s"] = [m[0] for m in rounds]
            if a.baseline_profile:
                rows[-1]["baseline_predicted_s"] = base
                rows[-1]["baseline_error"] = base / med_t - 1
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
    result = {"rows": rows, "choice": choice, "median_abs_error": med, "load_after": load,
              "calibrate_each_round": a.calibrate_each_round}
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
        paired = " (each round's prediction against the same round's measurement)" if a.calibrate_each_round else ""
        print(f"\nmedian |error|{paired}: {med * 100:.0f}%; load average after: {load}\n")
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
