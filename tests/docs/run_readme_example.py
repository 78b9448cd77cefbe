#!/usr/bin/env python3
"""Runs the PyTorch example of README.md (its first ```python block) as a newcomer would, under torchrun, and checks
what it computed against PyTorch's attention on the whole sequence: the gathered output within 1e-4 of the
reference it prints, and gradients on the full inputs. The example keeps its names (full, ref, q, k, v); a README
whose example no longer runs with the current package, or computes something else, fails here.

Usage: torchrun --nproc-per-node 2 run_readme_example.py README.md (PYTHONPATH with the build's python/ directory)."""

import os
import re
import sys


def main(readme):
    text = open(readme, encoding="utf-8").read()
    m = re.search(r"```python\n(.*?)```", text, re.S)
    if not m:
        print(f"error: {readme} has no ```python block")
        return 1
    scope = {"__name__": "__readme_example__"}
    exec(compile(m.group(1), f"{readme} (the PyTorch example)", "exec"), scope)
    full, ref, q = scope["full"], scope["ref"], scope["q"]
    err = (full - ref.transpose(1, 2)).abs().max().item()
    rank = int(os.environ.get("RANK", "0"))  # the example drops its grid before it ends
    if not err < 1e-4:
        print(f"error: rank {rank}: the README example's output is {err:.3g} from torch's attention (tolerance 1e-4)")
        return 1
    if q.grad is None or not bool(q.grad.abs().sum() > 0):
        print(f"error: rank {rank}: the README example's backward left no gradient on q")
        return 1
    if "mpi4py" in sys.modules:
        print(f"error: rank {rank}: the README example imported mpi4py under torchrun")
        return 1
    print(f"rank {rank}: the README example ran; output within {err:.2g} of torch's attention, gradients present")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
