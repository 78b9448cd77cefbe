"""fp32 accuracy of the MHA backward against S: seqpar's dk / dv (and dq) next to PyTorch's CPU flash backward.

For each S, fp32 inputs (uniform in [-1, 1], dout too) go to sp_bench (--attn mha, one process, --inputs / --dump)
and to PyTorch's CPU flash-attention kernels (aten._scaled_dot_product_flash_attention_for_cpu and its backward, the
SDPBackend.FLASH_ATTENTION path); both are compared with an fp64 reference computed here from the same fp32 values
(torch fp64 matrix products over blocks of query rows, with the exact softmax of each row). Error figures per
gradient: the relative error ||x - ref||_2 / ||ref||_2 and the largest absolute error max |x - ref|.

  python3 benchmarks/mha_grad_accuracy.py --sp-bench build/benchmarks/sp_bench [--seqs 1024,2048,4096,8192,16384]
      [--heads 2 --kv-heads 1 --head-dim 64] [--no-causal] [--sp-bench-before OTHER/sp_bench] [--json FILE]

--sp-bench-before adds the columns of a second sp_bench binary (e.g. a build of an earlier commit) on the same inputs.
Needs numpy and torch; sp_bench runs single-threaded (--threads 1), the reference on one thread.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch


def reference(q, k, v, do, causal, scale, block=512):
    """fp64 dq, dk, dv of softmax attention; q, do [S, Hq, D], k, v [S, Hkv, D] (fp64 torch tensors)."""
    S, Hq, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for h in range(Hq):
        hk = h // group
        qh, kh, vh, doh = q[:, h], k[:, hk], v[:, hk], do[:, h]
        for i0 in range(0, S, block):
            i1 = min(S, i0 + block)
            kend = i1 if causal else S
            s = (qh[i0:i1] @ kh[:kend].T) * scale
            if causal:
                rows = torch.arange(i0, i1).unsqueeze(1)
                cols = torch.arange(kend).unsqueeze(0)
                s = s.masked_fill(cols > rows, float("-inf"))
            p = torch.softmax(s, dim=1)
            out = p @ vh[:kend]
            delta = (doh[i0:i1] * out).sum(dim=1, keepdim=True)
            dp = doh[i0:i1] @ vh[:kend].T
            ds = p * (dp - delta)
            dv[:kend, hk] += p.T @ doh[i0:i1]
            dk[:kend, hk] += (ds.T @ qh[i0:i1]) * scale
            dq[i0:i1, h] += (ds @ kh[:kend]) * scale
    return dq, dk, dv


def errors(x, ref):
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref)), float(np.abs(x - ref).max())


def run_sp_bench(binary, d, S, a):
    cmd = [binary, "--attn", "mha", "--seq", str(S), "--heads", str(a.heads), "--kv-heads", str(a.kv_heads),
           "--head-dim", str(a.head_dim), f"--causal={'true' if a.causal else 'false'}", "--inputs", d, "--dump",
           os.path.join(d, "out"), "--warmup", "0", "--iters", "1", "--threads", "1", "--quiet"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return {n: np.load(os.path.join(d, "out", n + ".npy"))[0] for n in ("dq", "dk", "dv")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sp-bench", required=True)
    ap.add_argument("--sp-bench-before")
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--no-causal", dest="causal", action="store_false")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    fwd_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bwd_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    scale = 1.0 / a.head_dim ** 0.5
    impls = [("seqpar", a.sp_bench)] + ([("seqpar_before", a.sp_bench_before)] if a.sp_bench_before else [])
    print(f"# MHA backward fp32 error vs fp64: B 1, Hq {a.heads}, Hkv {a.kv_heads}, D {a.head_dim}, "
          f"{'causal' if a.causal else 'no mask'}, inputs and dout uniform in [-1, 1]; torch {torch.__version__}")
    print("# rel = ||x - ref|| / ||ref||, max = max |x - ref|")
    head = f"{'S':>6}"
    for name, _ in impls + [("torch_flash", None)]:
        for g in ("dk", "dv", "dq"):
            head += f" {name + ' ' + g + ' rel':>22} {'max':>9}"
    print(head)
    rows = []
    for S in (int(x) for x in a.seqs.split(",")):
        g = torch.Generator().manual_seed(a.seed + S)

        def make(h):
            return (torch.rand(1, S, h, a.head_dim, generator=g, dtype=torch.float32) * 2 - 1)

        q, k, v, do = make(a.heads), make(a.kv_heads), make(a.kv_heads), make(a.heads)
        got = {}
        with tempfile.TemporaryDirectory() as d:
            for n, t in (("q", q), ("k", k), ("v", v), ("dout", do)):
                np.save(os.path.join(d, n + ".npy"), t.numpy())
            for name, binary in impls:
                got[name] = run_sp_bench(binary, d, S, a)
        tq, tk, tv, tdo = (t.transpose(1, 2) for t in (q, k, v, do))
        out, lse = fwd_op(tq, tk, tv, 0.0, a.causal)
        tdq, tdk, tdv = bwd_op(tdo, tq, tk, tv, out, lse, 0.0, a.causal)[:3]
        got["torch_flash"] = {"dq": tdq.transpose(1, 2)[0].numpy(), "dk": tdk.transpose(1, 2)[0].numpy(),
                              "dv": tdv.transpose(1, 2)[0].numpy()}
        rq, rk, rv = reference(q[0].double(), k[0].double(), v[0].double(), do[0].double(), a.causal, scale)
        ref = {"dq": rq.numpy(), "dk": rk.numpy(), "dv": rv.numpy()}
        row = {"S": S}
        line = f"{S:>6}"
        for name in [n for n, _ in impls] + ["torch_flash"]:
            for gname in ("dk", "dv", "dq"):
                rel, mx = errors(got[name][gname], ref[gname])
                row[f"{name}_{gname}_rel"] = rel
                row[f"{name}_{gname}_max"] = mx
                line += f" {rel:>22.3e} {mx:>9.2e}"
        print(line, flush=True)
        rows.append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "causal": a.causal,
                       "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
