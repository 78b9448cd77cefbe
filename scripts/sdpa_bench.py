#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention, forward and backward, timed like kernel_bench --device cuda: bf16
[B, H, S, D] (GQA by enable_gqa), causal and not, the fastest call of interleaved rounds, model FLOPs 4 B Hq S^2 D
(x0.5 causal), backward 2.5 x forward. scripts/gpu_check.sh runs it next to kernel_bench (the comparison with the
attention PyTorch users get). On --device cpu it runs fp32 at whatever size is given (the dry run's tiny shapes).

Usage: sdpa_bench.py [--device cuda|cpu] [--seq 4096,16384] [--dim 128] [--hq 8] [--hkv 2] [--batch 1]
                     [--min-time 1.0] [--json FILE]
"""
import argparse
import json
import sys
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--seq", default="4096,16384,65536")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--hq", type=int, default=8)
    p.add_argument("--hkv", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--min-time", type=float, default=1.0)
    p.add_argument("--json")
    a = p.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        sys.exit(f"sdpa_bench: PyTorch is needed ({e})")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(f"sdpa_bench: --device {a.device}: torch.cuda.is_available() is False")
    if a.hq % a.hkv != 0:
        sys.exit(f"sdpa_bench: --hq {a.hq} must be a multiple of --hkv {a.hkv}")
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(f"# sdpa_bench: torch {torch.__version__}"
          f" on {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'host'}), {dtype}, "
          f"B={a.batch} Hq={a.hq} Hkv={a.hkv}")
    print(f"{'S':>7} {'D':>5} {'mask':>7} {'fwd_ms':>10} {'fwd_TF/s':>10} {'bwd_ms':>10} {'bwd_TF/s':>10}")
    rows = []
    for s in [int(x) for x in a.seq.split(",")]:
        for causal in (False, True):
            q = torch.randn(a.batch, a.hq, s, a.dim, device=dev, dtype=dtype, requires_grad=True)
            k = torch.randn(a.batch, a.hkv, s, a.dim, device=dev, dtype=dtype, requires_grad=True)
            v = torch.randn(a.batch, a.hkv, s, a.dim, device=dev, dtype=dtype, requires_grad=True)
            do = torch.randn(a.batch, a.hq, s, a.dim, device=dev, dtype=dtype)

            def fwd():
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=a.hkv != a.hq)

            def timed(fn):
                sync()
                t = time.perf_counter()
                r = fn()
                sync()
                return time.perf_counter() - t, r

            out = fwd()
            out.backward(do)  # warm-up
            best_f = best_b = float("inf")
            t0 = time.perf_counter()
            while True:
                tf, out = timed(fwd)
                tb, _ = timed(lambda: out.backward(do))
                best_f, best_b = min(best_f, tf), min(best_b, tb)
                if time.perf_counter() - t0 >= a.min_time:
                    break
            flops = 4.0 * a.batch * a.hq * s * s * a.dim * (0.5 if causal else 1.0)
            row = {"seq": s, "head_dim": a.dim, "causal": causal, "fwd_ms": best_f * 1e3,
                   "fwd_tflops": flops / best_f / 1e12, "bwd_ms": best_b * 1e3,
                   "bwd_tflops": 2.5 * flops / best_b / 1e12}
            rows.append(row)
            print(f"{s:7d} {a.dim:5d} {'causal' if causal else 'none':>7} {row['fwd_ms']:10.3f} "
                  f"{row['fwd_tflops']:10.2f} {row['bwd_ms']:10.3f} {row['bwd_tflops']:10.2f}", flush=True)
            del q, k, v, do, out
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"benchmark": "sdpa_bench", "torch": torch.__version__, "device": str(dev),
                       "dtype": str(dtype), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
