#!/usr/bin/env python3
"""sp_plan's memory verdict against the sp_bench binary: with the node's memory set to what sp_plan was told
(--test-mem-available-mib = devices_per_node x --mem-per-device), the configurations sp_plan ranks are accepted by
`sp_bench --dry-run` ("fits"), the ones it excludes for memory are refused ("does NOT fit") and a real run of one
stops with sp_bench's memory error; the ones it excludes by a rule fail sp_bench's parser with the same message.
With --mode decode, the same for the configurations of a decode step (sp_bench --mode decode's own rules).
The first choice's printed command, copied as it is (sp_plan called by a relative path from the build directory,
as the docs call it from the repository root), runs from that directory.

  test_sp_plan_dry_run.py SP_PLAN SP_BENCH MPIEXEC NP_FLAG
"""
import json
import os
import shlex
import subprocess
import sys
import tempfile

PROBLEM = ["--attn", "mha", "--heads", "3", "--kv-heads", "1", "--head-dim", "64", "--seq", "16K", "--causal"]
WORLD = 2
# --mode decode: 3 KV heads cannot be split over (nor replicated across) an Ulysses group of 2.
DECODE_PROBLEM = ["--attn", "mha", "--heads", "6", "--kv-heads", "3", "--head-dim", "64", "--context", "4K"]
MEM_MIB = 200  # per device: p2p rings fit (192.4 MiB a rank), all-gather (206.4 MiB: the whole K / V) does not


def main():
    sp_plan, sp_bench, mpiexec, np_flag = sys.argv[1:5]
    profile = {"name": "flat",
               "kernels": {k: {"points": [[1, 1e10]], "source": "test"} for k in ("mha_fwd", "mha_bwd")},
               "links": {"intra": {"latency_s": 1e-5, "bandwidth_bytes_per_s": 5e9, "source": "test"},
                         "inter": {"latency_s": 1e-5, "bandwidth_bytes_per_s": 5e9, "source": "test"}}}
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        prof = os.path.join(tmp, "profile.json")
        with open(prof, "w") as f:
            json.dump(profile, f)
        plan_json = os.path.join(tmp, "plan.json")
        subprocess.run([sp_plan, "--profile", prof, "--world", str(WORLD), "--mem-per-device", f"{MEM_MIB}M",
                        "--json", plan_json, "--"] + PROBLEM, check=True, stdout=subprocess.DEVNULL)
        with open(plan_json) as f:
            plan = json.load(f)
        memory_excluded = [r for r in plan["excluded"] if r["reason"].startswith("does not fit in memory")]
        rule_excluded = [r for r in plan["excluded"] if not r["reason"].startswith("does not fit in memory")]
        if not plan["ranked"] or not memory_excluded:
            failures.append(f"expected both fitting and non-fitting configurations: {len(plan['ranked'])} ranked, "
                            f"{len(memory_excluded)} excluded for memory")
        node_mib = str(WORLD * MEM_MIB)

        def bench(row, extra):
            cmd = [mpiexec, np_flag, str(WORLD), sp_bench] + PROBLEM + row["sp_bench_flags"] + [
                "--test-mem-available-mib", node_mib] + extra
            return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        for row in plan["ranked"] + memory_excluded:
            fits = row in plan["ranked"]
            out = bench(row, ["--dry-run"])
            verdict = ": fits" in out.stdout and "does NOT fit" not in out.stdout
            if out.returncode != 0 or verdict != fits:
                failures.append(f"{row['name']}: sp_plan says {'fits' if fits else 'does not fit'}, sp_bench "
                                f"--dry-run (rc {out.returncode}):\n{out.stdout}")
            else:
                print(f"ok: {row['name']}: {'fits' if fits else 'does NOT fit'} in both")
        if memory_excluded:
            out = bench(memory_excluded[0], ["--warmup", "0", "--iters", "1"])
            if out.returncode == 0 or "memory estimate:" not in out.stdout:
                failures.append(f"{memory_excluded[0]['name']}: a real run was not refused:\n{out.stdout}")
            else:
                print(f"ok: {memory_excluded[0]['name']}: the run is refused (memory estimate)")
        for row in rule_excluded:
            out = bench(row, ["--dry-run"])
            if out.returncode == 0 or row["reason"] not in out.stdout:
                failures.append(f"{row['name']}: sp_plan's reason '{row['reason']}' not in sp_bench's "
                                f"(rc {out.returncode}):\n{out.stdout}")
            else:
                print(f"ok: {row['name']}: refused by both: {row['reason']}")
        # The command a user copies: sp_plan called as benchmarks/sp_plan from the build directory names sp_bench
        # beside it (it printed a bare "sp_bench", not found unless installed on the PATH).
        build_dir = os.path.dirname(os.path.dirname(os.path.abspath(sp_plan)))
        out = subprocess.run([os.path.relpath(os.path.abspath(sp_plan), build_dir), "--profile", prof, "--world",
                              str(WORLD), "--mem-per-device", f"{MEM_MIB}M", "--"] + PROBLEM, cwd=build_dir,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = [l for l in out.stdout.splitlines() if l.startswith("# first choice: ")]
        words = shlex.split(lines[0][len("# first choice: "):]) if lines else []
        if out.returncode != 0 or not words or words[0] != "mpirun":
            failures.append(f"sp_plan from {build_dir} (rc {out.returncode}): no '# first choice: mpirun ...' "
                            f"line:\n{out.stdout}")
        else:
            run = subprocess.run([mpiexec] + words[1:] + ["--dry-run", "--test-mem-available-mib", node_mib],
                                 cwd=build_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if run.returncode != 0 or ": fits" not in run.stdout:
                failures.append(f"the first choice's command {' '.join(words)} in {build_dir} --dry-run "
                                f"(rc {run.returncode}):\n{run.stdout}")
            else:
                print(f"ok: the first choice's command runs from {build_dir}: {' '.join(words)}")
        # --mode decode: every configuration sp_plan ranks is accepted by `sp_bench --mode decode --dry-run` with its
        # flags (decode has rules of its own: the KV heads over the Ulysses group, the attention options it does not
        # take), and each one it excludes by a rule is refused by sp_bench with that rule's message.
        plan_json = os.path.join(tmp, "plan_decode.json")
        subprocess.run([sp_plan, "--profile", prof, "--world", str(WORLD), "--mode", "decode", "--json", plan_json,
                        "--"] + DECODE_PROBLEM, check=True, stdout=subprocess.DEVNULL)
        with open(plan_json) as f:
            plan = json.load(f)
        if not plan["ranked"] or not plan["excluded"]:
            failures.append(f"decode: expected ranked and excluded configurations: {len(plan['ranked'])} ranked, "
                            f"{len(plan['excluded'])} excluded")
        for row in plan["ranked"] + plan["excluded"]:
            cmd = [mpiexec, np_flag, str(WORLD), sp_bench] + DECODE_PROBLEM + row["sp_bench_flags"] + ["--dry-run"]
            out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            ranked = row in plan["ranked"]
            ok = out.returncode == 0 if ranked else (out.returncode != 0 and row["reason"] in out.stdout)
            if not ok:
                said = "ranks it" if ranked else "excludes it: " + row["reason"]
                failures.append(f"decode {row['name']}: sp_plan {said}, sp_bench --dry-run (rc {out.returncode}):\n"
                                f"{out.stdout}")
            else:
                print(f"ok: decode {row['name']}: {'accepted' if ranked else 'refused'} by both")
    for f in failures:
        print("FAIL:", f)
    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
