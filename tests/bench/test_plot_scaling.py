#!/usr/bin/env python3
"""scripts/plot.py draws sp_plan's predicted scaling: --published (scripts/sp_plan_published.py --quick's JSON:
4 methods x 2 CP sizes = 8 predicted points) and --plans (sp_plan --json at 2 and 4 ranks of one problem, with
--points as markers: every family with more than one rank at each size). Checks the PNGs are written and the point
counts plot.py reports are those of its inputs. Needs matplotlib: this Python's, else /usr/bin/python3's (Debian's
python3-matplotlib); without it the test is skipped (exit 77) and says why.

  test_plot_scaling.py SP_PLAN
"""
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def python_with_matplotlib():
    for py in (sys.executable, "/usr/bin/python3"):
        if os.path.exists(py) and subprocess.run([py, "-c", "import matplotlib"], capture_output=True).returncode == 0:
            return py
    return None


def main():
    sp_plan = sys.argv[1]
    py = python_with_matplotlib()
    if py is None:
        print("SKIP: no Python with matplotlib (install python3-matplotlib: scripts/install_deps.sh)")
        sys.exit(77)
    failures = []
    plot = os.path.join(ROOT, "scripts", "plot.py")
    with tempfile.TemporaryDirectory() as tmp:
        pub = os.path.join(tmp, "published.json")
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "sp_plan_published.py"), "--sp-plan", sp_plan,
                        "--quick", "--json", pub], check=True, stdout=subprocess.DEVNULL)
        out = os.path.join(tmp, "pub.png")
        msg = subprocess.run([py, plot, "--published", pub, "--mask", "causal", "--phase", "fwd", "--out", out],
                             check=True, capture_output=True, text=True).stdout
        if "(8 predicted points)" not in msg:
            failures.append(f"--published: {msg.strip()!r}, expected 8 predicted points")
        plans, expected = [], 0
        for world in (2, 4):
            pj = os.path.join(tmp, f"plan{world}.json")
            subprocess.run([sp_plan, "--profile", os.path.join(ROOT, "benchmarks", "profiles", "h100_sxm.json"),
                            "--world", str(world), "--json", pj, "--", "--attn", "mha", "--heads", "8",
                            "--head-dim", "128", "--seq", "16K", "--causal", "--dtype", "bf16"],
                           check=True, stdout=subprocess.DEVNULL)
            with open(pj) as f:
                ranked = json.load(f)["ranked"]
            fams = set()
            for r in ranked:
                pu, pr = r["ulysses_size"], r["ring_size"]
                kind = "ring" if pu == 1 else "ulysses" if pr == 1 else f"usp u{pu}"
                fams.add((kind, r["layout"], r.get("impl", "")))
            expected += len(fams)
            plans.append(pj)
        points = os.path.join(tmp, "points.csv")
        with open(points, "w") as f:
            f.write("world,label,value_ms\n2,measured,5.0\n4,measured,3.0\n")
        out2 = os.path.join(tmp, "plans.png")
        msg = subprocess.run([py, plot, "--plans"] + plans + ["--points", points, "--out", out2], check=True,
                             capture_output=True, text=True).stdout
        m = re.search(r"\((\d+) predicted points\)", msg)
        if not m or int(m.group(1)) != expected:
            failures.append(f"--plans: {msg.strip()!r}, expected {expected} predicted points")
        for png in (out, out2):
            with open(png, "rb") as f:
                if f.read(8) != b"\x89PNG\r\n\x1a\n":
                    failures.append(f"{png} is not a PNG")
    for f in failures:
        print("FAIL:", f)
    print(f"plot.py --published and --plans: {len(failures)} failures")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
