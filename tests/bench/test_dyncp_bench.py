#!/usr/bin/env python3
"""sp_plan --dynamic-cp's JSON and dyncp_bench end to end at 2 ranks: every plan of the JSON covers every document
exactly once on groups that exist, the reported gain is best static / dynamic - 1 >= 0, dyncp_bench runs the
dynamic, mixed and static plans of that file (printing each plan's step_s as its predicted time), and bad degrees
fail sp_plan naming the rule.

  test_dyncp_bench.py SP_PLAN DYNCP_BENCH MPIEXEC NP_FLAG
"""
import json
import os
import subprocess
import sys
import tempfile

PROBLEM = ["--attn", "mha", "--heads", "2", "--head-dim", "16", "--causal"]
DOCS = "700,40,300,12,90,5,260,33,128,64"
WORLD = 2


def check_plan(p, ndocs, world, failures):
    if "excluded" in p:
        return
    seen = [0] * ndocs
    for m in p["micro_batches"]:
        for d in m["docs"]:
            seen[d] += 1
        if world % m["degree"] or not 0 <= m["group"] < world // m["degree"]:
            failures.append(f"{p['name']}: micro-batch on degree {m['degree']} group {m['group']}")
    if seen != [1] * ndocs:
        failures.append(f"{p['name']}: documents seen {seen}")


def main():
    sp_plan, bench, mpiexec, np_flag = sys.argv[1:5]
    src = "a flat test profile: round numbers, measured nowhere"
    profile = {"name": "flat", "kernels": {k: {"points": [[1, 1e9]], "source": src} for k in ("mha_fwd", "mha_bwd")},
               "links": {"intra": {"latency_s": 1e-4, "bandwidth_bytes_per_s": 1e8, "source": src},
                         "inter": {"latency_s": 1e-4, "bandwidth_bytes_per_s": 1e8, "source": src}}}
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        prof = os.path.join(tmp, "profile.json")
        with open(prof, "w") as f:
            json.dump(profile, f)
        plan_json = os.path.join(tmp, "plan.json")
        out = subprocess.run([sp_plan, "--profile", prof, "--world", str(WORLD), "--dynamic-cp", "--doc-lens", DOCS,
                              "--tokens-per-rank", "512", "--json", plan_json, "--"] + PROBLEM,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        print(out.stdout)
        if out.returncode != 0 or "predicted gain" not in out.stdout:
            failures.append(f"sp_plan --dynamic-cp failed (rc {out.returncode})")
        with open(plan_json) as f:
            plan = json.load(f)
        ndocs = len(DOCS.split(","))
        for p in [plan["dynamic"], plan["mixed"]] + plan["statics"]:
            check_plan(p, ndocs, WORLD, failures)
        best = plan["best_static_step_s"]
        gain = plan["predicted_gain"]
        if gain < 0 or abs(gain - (best / plan["dynamic"]["step_s"] - 1)) > 1e-12:
            failures.append(f"gain {gain} is not best static {best} / dynamic {plan['dynamic']['step_s']} - 1 >= 0")
        runs = "dynamic,mixed," + ",".join(s["name"] for s in plan["statics"] if "excluded" not in s)
        out = subprocess.run([mpiexec, np_flag, str(WORLD), bench, "--plan", plan_json, "--run", runs, "--rounds", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        print(out.stdout)
        if out.returncode != 0 or "per round:" not in out.stdout:
            failures.append(f"dyncp_bench failed (rc {out.returncode})")
        # Its predicted(s) column is the plan's step_s to 6 digits (a sub-millisecond plan used to print 0.000).
        want = {"dynamic": plan["dynamic"]["step_s"], "mixed": plan["mixed"]["step_s"]}
        want.update({s["name"]: s["step_s"] for s in plan["statics"] if "excluded" not in s})
        for name, step_s in want.items():
            rows = [line[3 + 16:].split()[0] for line in out.stdout.splitlines()
                    if line.startswith("   " + name.ljust(16) + " ")]
            if len(rows) != 1 or abs(float(rows[0]) - step_s) > 1e-5 * step_s:
                failures.append(f"dyncp_bench: predicted(s) of {name} is {rows}, not the step_s {step_s}")
        out = subprocess.run([sp_plan, "--profile", prof, "--world", str(WORLD), "--dynamic-cp", "--doc-lens", DOCS,
                              "--degrees", "1,3", "--"] + PROBLEM, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        if out.returncode == 0 or "degree 3 must divide the world size 2" not in out.stdout:
            failures.append(f"--degrees 1,3 at world 2 was not refused by the rule (rc {out.returncode}):\n{out.stdout}")
    for f in failures:
        print("FAILED:", f)
    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
