#!/usr/bin/env python3
"""fla's chunk gated-delta-rule forward and backward (fla.ops.gated_delta_rule.chunk_gated_delta_rule, Triton) timed at
the shapes of `ops_bench --kernel gdn`, for scripts/gpu_check.sh: batch 1, Hv value heads on Hk key heads (fla's GVA), K, V,
chunk 64, q and k L2-normalised in the kernel, zero initial state, final state written, inputs random as ops_bench's
(q, k, v in [-1, 1], g in [-0.2, -0.01], beta in [0.05, 0.95]; dout in [-1, 1]). fp32 and bf16 inputs, one row per
S of --seq (a comma list) and dtype. Forward: the call without autograd. Backward: every input requiring grad, the
forward run untimed, then out.backward(dout) timed alone (the gradients of q, k, v, g, beta; none of the final state).
Times: CUDA events, median of the timed rounds after --warmup untimed ones (the first call includes Triton's
compilation and autotuning). Model FLOPs as ops_bench's: forward S*Hv*(6*C*K + 4*C*V + 6*K*V), backward 2.5 x.
With --ops-json (ops_bench's JSON of the same job), each row also gives composed / fla per direction: ops_bench's
fwd_ms and bwd_ms (the composed fp32 calls, host transfers included) over fla's at the same S and shape ("-" and
null where ops_bench has no such row).

fla comes from the checkout's .deps/fla (scripts/install_gpu_deps.sh) or the environment. Without PyTorch, a CUDA
device or fla, prints "# fla: skipped: <reason>" and exits 0 (the comparison is then absent, said so). --dry-run
(gpu_check.sh --dry-run) only says whether PyTorch and fla are installed, without importing them.
"""
import argparse
import json
import os
import sys


def composed_rows(path, Hv, Hk, K, V, C):
    """ops_bench's GDN rows of this shape by S, from its JSON; {} without one."""
    if not path:
        return {}
    with open(path) as f:
        rows = json.load(f)
    return {r["S"]: r for r in rows if r.get("kernel") == "gdn" and (r["Hv"], r["Hk"], r["K"], r["V"], r["chunk_size"])
            == (Hv, Hk, K, V, C)}


def median_seconds(torch, fn, warmup, min_time, setup=lambda: None):
    """Median seconds of fn(setup()) by CUDA events over at least 3 rounds and min_time, after warmup untimed ones;
    setup runs untimed before each call."""
    for _ in range(warmup):
        fn(setup())
    torch.cuda.synchronize()
    times, total = [], 0.0
    while len(times) < 3 or total < min_time:
        arg = setup()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn(arg)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
        total += times[-1]
    return sorted(times)[len(times) // 2]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", default="8192", help="comma list of sequence lengths")
    p.add_argument("--heads", type=int, default=32, help="value heads Hv")
    p.add_argument("--kv-heads", type=int, default=16, help="key heads Hk")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dim-v", type=int, default=128)
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--min-time", type=float, default=0.5)
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--ops-json", help="ops_bench's JSON: the composed times to set against fla's")
    p.add_argument("--dry-run", action="store_true", help="say what is installed; import and time nothing")
    a = p.parse_args()
    deps = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".deps", "fla")
    if os.path.isdir(deps):
        sys.path.insert(0, deps)
    if a.dry_run:
        import importlib.util
        found = {m: importlib.util.find_spec(m) is not None for m in ("torch", "triton", "fla", "einops")}
        print("# fla: dry run, nothing timed (fla's kernels need a GPU); installed: "
              + ", ".join(f"{m} {'yes' if ok else 'no'}" for m, ok in found.items()))
        composed = composed_rows(a.ops_json, a.heads, a.kv_heads, a.head_dim, a.dim_v, 64)
        if a.ops_json:
            print(f"# fla: dry run: ops_bench's composed rows to set against fla's: S {sorted(composed) or 'none'}"
                  + ("" if all("bwd_ms" in r for r in composed.values()) else " (some without bwd_ms)"))
        if a.json:
            with open(a.json, "w") as f:
                json.dump([], f)
        return 0
    try:
        import torch
    except ImportError as e:
        print(f"# fla: skipped: PyTorch not importable ({e})")
        return 0
    if not torch.cuda.is_available():
        print("# fla: skipped: torch.cuda.is_available() is False (fla's kernels are Triton on a GPU)")
        return 0
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # fla missing, or its Triton / PyTorch requirements unmet
        print(f"# fla: skipped: fla not importable ({type(e).__name__}: {e}); scripts/install_gpu_deps.sh puts it in .deps/fla")
        return 0
    import fla

    Hv, Hk, K, V, C = a.heads, a.kv_heads, a.head_dim, a.dim_v, 64
    composed = composed_rows(a.ops_json, Hv, Hk, K, V, C)
    print(f"#\n# fla {getattr(fla, '__version__', '?')} chunk_gated_delta_rule forward and backward, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}, B=1 Hv={Hv} Hk={Hk} K={K} V={V} chunk={C}, qk L2 norm in kernel")
    print(f"{'S':>7} {'dtype':>6} {'fwd_ms':>10} {'fwd_TF/s':>10} {'bwd_ms':>10} {'bwd_TF/s':>10} {'fwd_cmp/fla':>11} "
          f"{'bwd_cmp/fla':>11}")
    rows = []
    dev = torch.device("cuda")
    for S in (int(s) for s in a.seq.split(",")):
        for name in a.dtypes.split(","):
            dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
            gen = torch.Generator(device=dev).manual_seed(0)

            def uni(shape, lo, hi):
                return (torch.rand(shape, generator=gen, device=dev) * (hi - lo) + lo).to(dt)

            q, k = uni((1, S, Hk, K), -1, 1), uni((1, S, Hk, K), -1, 1)
            v = uni((1, S, Hv, V), -1, 1)
            g = uni((1, S, Hv), -0.2, -0.01).float()
            beta = uni((1, S, Hv), 0.05, 0.95)
            dout = uni((1, S, Hv, V), -1, 1)

            def call():
                return chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)

            with torch.no_grad():
                t = median_seconds(torch, lambda _: call(), a.warmup, a.min_time)
            for x in (q, k, v, g, beta):
                x.requires_grad_(True)

            def backward(out):
                out.backward(dout)
                for x in (q, k, v, g, beta):
                    x.grad = None

            tb = median_seconds(torch, backward, a.warmup, a.min_time, setup=lambda: call()[0])
            flops = S * Hv * (6 * C * K + 4 * C * V + 6 * K * V)
            c = composed.get(S)
            rf = c["fwd_ms"] / (t * 1e3) if c else None
            rb = c["bwd_ms"] / (tb * 1e3) if c and "bwd_ms" in c else None
            cell = lambda r: f"{r:>11.3f}" if r is not None else f"{'-':>11}"
            print(f"{S:>7} {name:>6} {t * 1e3:>10.3f} {flops / t * 1e-12:>10.4g} {tb * 1e3:>10.3f} "
                  f"{2.5 * flops / tb * 1e-12:>10.4g} {cell(rf)} {cell(rb)}", flush=True)
            rows.append({"kernel": "gdn", "impl": "fla", "S": S, "Hv": Hv, "Hk": Hk, "K": K, "V": V, "chunk_size": C,
                         "dtype": name, "fwd_ms": t * 1e3, "model_tflops": flops / t * 1e-12, "bwd_ms": tb * 1e3,
                         "bwd_model_tflops": 2.5 * flops / tb * 1e-12, "composed_over_fla_fwd": rf,
                         "composed_over_fla_bwd": rb})
            del q, k, v, g, beta, dout
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
