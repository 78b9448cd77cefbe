#!/usr/bin/env python3
"""The cost of the Python boundary: one CP layer's forward and backward called from PyTorch (seqpar's autograd
functions, DLPack views) against the same call from C++ (sp_bench), same shapes, grid, layout and one thread per rank.

    python3 python/bench/overhead.py --np 4 --sp-bench build/benchmarks/sp_bench --seq 8K [--attn gdn]

Runs two jobs one after the other: `mpirun -np N sp_bench ... --json` and `mpirun -np N python3 <this script>
--worker`, which times the Python layer the way sp_bench times (ranks synchronised by a barrier before each phase,
an iteration's time is the slowest rank's, --iters after --warmup), alternating the two jobs --rounds times so that
both see the same load of a shared machine. Prints the fastest and the median iteration of each and the overhead
= Python / C++ - 1 per phase (the fastest iterations are the least disturbed by other processes). The worker needs the module: PYTHONPATH=<build>/python (or pip install .).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import seqpar


def parse_len(text):
    text = text.upper()
    factor = {"K": 1024, "M": 1024 * 1024}.get(text[-1], 1)
    return int(text[:-1] if factor > 1 else text) * factor


def time_python(grid, args):
    seq_len = parse_len(args.seq)
    layout = seqpar.SequenceLayout.for_grid(grid, seq_len, args.layout)
    s_local = layout.local_len
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}[args.dtype]
    torch.manual_seed(grid.cp_rank)
    if args.attn == "mha":
        layer = seqpar.MhaCp(grid, layout, impl=args.impl, causal=True)
        kv = args.kv_heads or args.heads
        shapes = [(1, s_local, args.heads, args.head_dim), (1, s_local, kv, args.head_dim),
                  (1, s_local, kv, args.head_dim)]
        inputs = [torch.randn(s, dtype=dtype).requires_grad_() for s in shapes]
        call = lambda: layer(*inputs)  # noqa: E731
    else:
        layer = seqpar.GdnCp(grid, layout, mode=args.gdn_mode)
        hk = args.kv_heads or args.heads
        q, k = (torch.randn(1, s_local, hk, args.head_dim, dtype=dtype) for _ in range(2))
        q, k = (torch.nn.functional.normalize(t, dim=-1).requires_grad_() for t in (q, k))
        v = torch.randn(1, s_local, args.heads, args.head_dim, dtype=dtype).requires_grad_()
        g = torch.nn.functional.logsigmoid(torch.randn(1, s_local, args.heads) + 3).to(dtype).requires_grad_()
        beta = torch.rand(1, s_local, args.heads).to(dtype).requires_grad_()
        inputs = [q, k, v, g, beta]
        call = lambda: layer(*inputs)[0]  # noqa: E731
    times = {"fwd": [], "bwd": [], "fwd+bwd": []}
    slowest = torch.zeros(2, dtype=torch.float64)
    for it in range(args.warmup + args.iters):
        grid.world.barrier()
        t0 = time.perf_counter()
        out = call()
        t1 = time.perf_counter()
        dout = torch.ones_like(out)
        grid.world.barrier()
        t2 = time.perf_counter()
        out.backward(dout)
        t3 = time.perf_counter()
        slowest[0], slowest[1] = t1 - t0, t3 - t2
        grid.world.all_reduce(slowest, "max")
        if it >= args.warmup:
            times["fwd"].append(slowest[0].item() * 1e3)
            times["bwd"].append(slowest[1].item() * 1e3)
            times["fwd+bwd"].append((slowest[0].item() + slowest[1].item()) * 1e3)
        for t in inputs:
            t.grad = None
    return times


def common_flags(args):
    flags = ["--attn", args.attn, "--seq", args.seq, "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
             "--head-dim", str(args.head_dim), "--ulysses-size", str(args.ulysses_size), "--layout", args.layout,
             "--dtype", args.dtype, "--warmup", str(args.warmup), "--iters", str(args.iters)]
    return flags + (["--impl", args.impl] if args.attn == "mha" else ["--gdn-mode", args.gdn_mode])


def summary(iters_ms):
    return min(iters_ms), statistics.median(iters_ms)


def run_job(args, program, extra, json_path):
    cmd = ["mpirun", "-np", str(args.np), *program, *common_flags(args), *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(json_path) as f:
        return json.load(f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--np", type=int, default=4, help="ranks of both jobs")
    parser.add_argument("--sp-bench", help="path of the sp_bench binary (launcher)")
    parser.add_argument("--worker", help="(internal) time the Python layer under mpirun, write JSON to this path")
    parser.add_argument("--attn", default="mha", choices=["mha", "gdn"])
    parser.add_argument("--seq", default="8K")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--ulysses-size", type=int, default=2)
    parser.add_argument("--layout", default="zigzag")
    parser.add_argument("--impl", default="p2p")
    parser.add_argument("--gdn-mode", default="scan")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two jobs")
    args = parser.parse_args()

    if args.worker:
        torch.set_num_threads(1)
        world = seqpar.world()
        grid = seqpar.CpGrid(1, args.ulysses_size, world.size // args.ulysses_size)
        result = time_python(grid, args)
        if world.rank == 0:
            with open(args.worker, "w") as f:
                json.dump({"grid": str(grid), **result}, f)
        return 0

    if not args.sp_bench:
        parser.error("--sp-bench is required (the launcher runs it)")
    threads = os.environ.setdefault("OMP_NUM_THREADS", "1")
    cpp = {"fwd": [], "bwd": [], "fwd+bwd": []}
    py = {"fwd": [], "bwd": [], "fwd+bwd": []}
    with tempfile.TemporaryDirectory() as tmp:
        cpp_json, py_json = os.path.join(tmp, "cpp.json"), os.path.join(tmp, "py.json")
        sp_bench_flags = ["--ring-size", str(args.np // args.ulysses_size), "--threads", threads, "--json", cpp_json,
                          "--quiet"] + (["--causal"] if args.attn == "mha" else [])
        for _ in range(args.rounds):  # interleaved, so that both see the same load of a shared machine
            for p in run_job(args, [args.sp_bench], sp_bench_flags, cpp_json)["phases"]:
                cpp[p["phase"]] += p["time_iters_ms"]
            result = run_job(args, [sys.executable, os.path.abspath(__file__)], ["--worker", py_json], py_json)
            grid = result.pop("grid")
            for phase, values in result.items():
                py[phase] += values
    print(f"# {args.attn} S={args.seq} heads {args.heads}/{args.kv_heads} D {args.head_dim} {args.dtype}, grid {grid}, "
          f"{args.layout}, {threads} thread(s) per rank; {args.rounds} interleaved rounds of {args.iters} timed "
          f"iterations (after {args.warmup} warm-up) each; an iteration's time is the slowest rank's")
    print(f"{'phase':>9} {'C++ min':>10} {'Python min':>11} {'overhead':>9} {'C++ median':>11} {'Python median':>14} "
          f"{'overhead':>9}   (ms)")
    for phase in ("fwd", "bwd", "fwd+bwd"):
        (c_min, c_med), (p_min, p_med) = summary(cpp[phase]), summary(py[phase])
        print(f"{phase:>9} {c_min:10.2f} {p_min:11.2f} {100 * (p_min / c_min - 1):8.2f}% {c_med:11.2f} "
              f"{p_med:14.2f} {100 * (p_med / c_med - 1):8.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
