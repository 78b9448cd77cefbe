#!/usr/bin/env python3
"""The torch.distributed backend (gloo) against the MPI backend on the same work: the latency of a small all-reduce
over the grid's cp group, and one ring-attention forward + backward (MhaCp, fp32). Run the same file under both
launchers, alternating, and compare the fastest iterations (a shared machine's load disturbs the rest):

    PYTHONPATH=build/python mpirun -np 2 python3 python/bench/torch_backend.py
    PYTHONPATH=build/python torchrun --standalone --nproc-per-node 2 python/bench/torch_backend.py
"""

import argparse
import os
import statistics
import time

import torch

import seqpar


def timed(fn, grid, iters):
    times = []
    for _ in range(iters):
        grid.cp.barrier()
        start = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        grid.cp.all_reduce(t, "max")  # an iteration takes as long as its slowest rank
        times.append(t.item())
    return min(times), statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        grid, backend = seqpar.torch_grid(process_group=dist.group.WORLD), "torch (gloo)"
    else:
        grid, backend = seqpar.CpGrid(ring_size=seqpar.world().size), "mpi"
    small = torch.zeros(3, dtype=torch.int64)
    lat = timed(lambda: [grid.cp.all_reduce(small, "max") for _ in range(100)], grid, args.iters)
    layout = seqpar.SequenceLayout.for_grid(grid, args.seq)
    attn = seqpar.MhaCp(grid, layout, causal=True)
    q, k, v = (torch.randn(1, layout.local_len, 4, 64, requires_grad=True) for _ in range(3))

    def step():
        attn(q, k, v).sum().backward()

    step()  # warm-up
    fb = timed(step, grid, args.iters)
    if grid.world_rank == 0:
        print(f"{backend:>13} ranks {grid.cp.size}: all_reduce 24 B {lat[0] * 1e4:8.1f} us (median "
              f"{lat[1] * 1e4:8.1f}); MhaCp fwd+bwd S={args.seq} {fb[0] * 1e3:8.2f} ms (median {fb[1] * 1e3:8.2f})",
              flush=True)


if __name__ == "__main__":
    main()
