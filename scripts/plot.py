#!/usr/bin/python3
"""Plots a sweep.py CSV as one PNG with four panels (fwd+bwd phase): strong-scaling throughput and efficiency
against ranks, throughput against sequence length, and weak-scaling throughput per rank against ranks; one line
per grid/impl (and sequence length where several were swept). Uses matplotlib's Agg backend (no display needed);
on Debian: /usr/bin/python3 with python3-matplotlib.

  /usr/bin/python3 scripts/plot.py docs/sweep.csv --out docs/scaling.png
"""
import argparse
import csv
import os
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def num(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def fmt_seq(s):
    s = int(s)
    return f"{s // 1024}K" if s % 1024 == 0 else str(s)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="CSV written by scripts/sweep.py")
    ap.add_argument("--out", default="scaling.png", help="PNG to write")
    ap.add_argument("--phase", default="fwd+bwd", choices=["fwd", "bwd", "fwd+bwd"])
    ap.add_argument("--title", default="", help="extra title text (e.g. the machine)")
    ap.add_argument("--dpi", type=int, default=72)
    args = ap.parse_args()

    with open(args.csv, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["phase"] == args.phase]
    if not rows:
        sys.exit(f"plot.py: no rows with phase {args.phase!r} in {args.csv}")
    for r in rows:
        r["ranks"] = int(r["ranks"])
        r["seq"] = int(r["seq"])
        r["tflops_total"] = float(r["tflops_total"])
        r["tflops_per_rank"] = float(r["tflops_per_rank"])
        eff = num(r.get("efficiency"))
        r["eff"] = eff if eff is not None else num(r.get("sweep_efficiency"))
        r["eff_busy"] = num(r.get("efficiency_busy"))

    strong = [r for r in rows if r["scaling"] == "strong"]
    weak = [r for r in rows if r["scaling"] == "weak"]
    seqs = sorted({r["seq"] for r in strong})

    def label(r, with_seq):
        s = r["grid"] if r["impl"] in ("-", "p2p") else f"{r['grid']} {r['impl']}"
        return f"{s} S={fmt_seq(r['seq'])}" if with_seq else s

    def lines(data, key_fn, x, y, base_rows=None):
        """Groups rows into lines; the 1-rank baseline row (grid '1rank') starts every line of its group."""
        groups = defaultdict(list)
        bases = defaultdict(list)
        for r in data:
            if r["grid"] == "1rank":
                bases[r["seq"] if r["scaling"] == "strong" else "weak"].append(r)
            else:
                groups[key_fn(r)].append(r)
        out = []
        for name, rs in sorted(groups.items()):
            base_key = rs[0]["seq"] if rs[0]["scaling"] == "strong" else "weak"
            pts = sorted([(b[x], b[y]) for b in bases.get(base_key, []) if b[y] is not None] +
                         [(r[x], r[y]) for r in rs if r[y] is not None])
            out.append((name, pts))
        return out

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    many = len(seqs) > 1
    ax = axes[0][0]
    for name, pts in lines(strong, lambda r: label(r, many), "ranks", "tflops_total"):
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.set(title=f"strong scaling: throughput ({args.phase})", xlabel="ranks", ylabel="TFLOP/s (all ranks)")

    ax = axes[0][1]
    for r in strong:
        if r["grid"] == "1rank":
            r["eff"] = 1.0
    top = 1.15
    any_busy = False
    for name, pts in lines(strong, lambda r: label(r, many), "ranks", "eff"):
        line, = ax.plot(*zip(*pts), marker="o", label=name)
        top = max(top, max(y for _, y in pts) + 0.05)
        busy = [p for p in lines([r for r in strong if r["grid"] != "1rank"] +
                                 [dict(r, eff_busy=1.0) for r in strong if r["grid"] == "1rank"],
                                 lambda r: label(r, many), "ranks", "eff_busy") if p[0] == name]
        if busy and len(busy[0][1]) > 1:
            ax.plot(*zip(*busy[0][1]), marker="x", ls="--", color=line.get_color())
            top = max(top, max(y for _, y in busy[0][1]) + 0.05)
            any_busy = True
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set(title="strong scaling: parallel efficiency" +
           ("\n(solid: T1 alone; dashed: T1 with all ranks busy)" if any_busy else ""),
           xlabel="ranks", ylabel="T1 / (P x T_P)", ylim=(0, top))

    ax = axes[1][0]
    max_ranks = max((r["ranks"] for r in strong), default=1)
    groups = defaultdict(list)
    for r in strong:
        groups[f"{label(r, False)} P={r['ranks']}"].append((r["seq"], r["tflops_total"]))
    for name, pts in sorted(groups.items()):
        ax.plot(*zip(*sorted(pts)), marker="o", label=name)
    ax.set(title="throughput vs sequence length", xlabel="sequence length (tokens)", ylabel="TFLOP/s (all ranks)")
    ax.set_xscale("log", base=2)
    if seqs:
        ax.set_xticks(seqs)
        ax.set_xticklabels([fmt_seq(s) for s in seqs])
        ax.minorticks_off()

    ax = axes[1][1]
    if weak:
        for name, pts in lines(weak, lambda r: label(r, False), "ranks", "tflops_per_rank"):
            ax.plot(*zip(*pts), marker="o", label=name)
        per_rank = sorted({r["seq"] // r["ranks"] for r in weak})
        ax.set(title=f"weak scaling ({', '.join(fmt_seq(s) for s in per_rank)} tokens/rank)", xlabel="ranks",
               ylabel="TFLOP/s per rank")
    else:
        ax.text(0.5, 0.5, "no weak-scaling runs", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()

    for a in axes.flat:
        if a.lines:
            a.grid(True, alpha=0.3)
            a.legend(fontsize=7)
            if a.get_xlabel() == "ranks":
                a.set_xticks(sorted({r["ranks"] for r in rows}))
    r0 = rows[0]
    shape = (f"B={r0['batch']} Hq={r0['heads']} Hkv={r0['kv_heads']} D={r0['head_dim']} "
             f"{'causal' if r0['causal'] == '1' else 'full'} {r0['layout']} {r0['dtype']}, {r0['threads']} thread(s)/rank")
    fig.suptitle(f"seqpar sp_bench: {shape}" + (f"\n{args.title}" if args.title else ""), fontsize=10)
    fig.tight_layout()
    # A temporary name in the same directory, renamed when complete (no truncated PNG on a full disk).
    root, ext = os.path.splitext(args.out)
    tmp_out = f"{root}.tmp{os.getpid()}{ext or '.png'}"
    try:
        fig.savefig(tmp_out, dpi=args.dpi)
        os.replace(tmp_out, args.out)
    except OSError as e:
        if os.path.exists(tmp_out):
            os.remove(tmp_out)
        sys.exit(f"plot.py: cannot write {args.out}: {e}")
    print(f"plot.py: wrote {args.out} ({len(rows)} rows, phase {args.phase}, largest run {max_ranks} ranks)",
          file=sys.stderr)


if __name__ == "__main__":
    main()
