#!/usr/bin/python3
"""Plots the strong-scaling runs of one attention kind of a sweep.py CSV as one PNG of six panels (one phase, default
fwd+bwd), every panel against ranks with one colour per algorithm throughout (1rank, the shared baseline, in black)
and one line style per sequence length:
  time (error bars: min and max over the timed iterations) with the ideal-scaling line T1 / P;
  parallel efficiency T1 / (P x T_P) (bars from the same spread), with 1 marked;
  throughput (TFLOP/s, all ranks; bars from the spread);
  bytes sent per rank (MiB); exposed communication (% of the phase time);
  peak memory per rank by ledger category (stacked bars per algorithm and rank count, longest sequence), with the
  sweep's memory estimate as a marker.
Every y axis starts at zero; ranks are on a log2 axis. Uses matplotlib's Agg backend (no display needed): on Debian python3-matplotlib
(scripts/install_deps.sh installs it).

  scripts/plot.py docs/sweep.csv --attn mha --out docs/scaling.png

Predicted scaling (sp_plan): --plans takes sp_plan --json files of one problem at several world sizes and draws each
configuration family's predicted step time against the CP size (ring, Ulysses, USP with its Ulysses size; one line per
layout and implementation), with --points CSV (columns world, label, value_ms: measured or published times) as
markers; --published takes the JSON of scripts/sp_plan_published.py and draws predicted TFLOPS/s per GPU (lines)
against the published ones (markers) for one --mask and --phase:

  scripts/plot.py --plans plan_cp2.json plan_cp4.json --points measured.csv --out predicted.png
  scripts/plot.py --published build/published.json --mask causal --phase fwd --out magi_causal_fwd.png
"""
import argparse
import csv
import json
import math
import os
import sys
from collections import defaultdict

try:
    import matplotlib
except ImportError:
    sys.exit(f"plot.py: matplotlib does not import in {sys.executable}; install it there "
             f"({sys.executable} -m pip install matplotlib) or run the script with /usr/bin/python3 "
             "(Debian's python3-matplotlib, which scripts/install_deps.sh installs)")

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

MEM_CATEGORIES = [("model_state", "model"), ("saved_activation", "saved"), ("persistent_cache", "cache"),
                  ("workspace", "workspace"), ("comm_buffer", "comm")]
LINE_STYLES = ["-", "--", ":", "-."]
BASELINE = "1rank"


def num(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def fmt_seq(s):
    s = int(s)
    return f"{s // 1024}K" if s % 1024 == 0 else str(s)


def load(path, attn, phase):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    kinds = sorted({r.get("attn", "mha") for r in rows})
    if attn is None:
        if len(kinds) > 1:
            sys.exit(f"plot.py: {path} holds several kinds ({', '.join(kinds)}); choose one with --attn")
        attn = kinds[0] if kinds else "mha"
    rows = [r for r in rows if r.get("attn", "mha") == attn and r["phase"] == phase and r["scaling"] == "strong"]
    if not rows:
        sys.exit(f"plot.py: no strong-scaling rows of --attn {attn}, phase {phase!r} in {path}")
    for r in rows:
        r["ranks"] = int(r["ranks"])
        r["seq"] = int(r["seq"])
        for k in ("time_ms", "tflops_total", "exposed_comm_pct", "bytes_sent_per_rank", "flops"):
            r[k] = float(r[k])
        r["tmin"] = num(r.get("time_min_ms")) or r["time_ms"]
        r["tmax"] = num(r.get("time_max_ms")) or r["time_ms"]
    return attn, rows


def family(r):
    """A configuration's family across CP sizes: the grid with the CP size left out."""
    pu, pr = r["ulysses_size"], r["ring_size"]
    rest = " ".join(x for x in (r["layout"], r.get("impl", ""), r.get("gdn_mode", ""), r.get("dsa_select", ""),
                                r.get("cache_shard", "")) if x)
    if pu == 1 and pr == 1:
        return None
    if pu == 1:
        return f"ring {rest}"
    if pr == 1:
        return f"ulysses {rest}"
    return f"usp u{pu} {rest}"


def save(fig, out, dpi):
    tmp_out = out + ".tmp.png"
    try:
        fig.savefig(tmp_out, dpi=dpi)
        os.replace(tmp_out, out)
    except OSError as e:
        sys.exit(f"plot.py: cannot write {out}: {e}")


def plot_scaling(args):
    """Predicted lines against measured / published markers over the CP size."""
    fig, ax = plt.subplots(figsize=(8, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if args.published:
        with open(args.published) as f:
            rows = [r for r in json.load(f)["magiattention"] if r["mask"] == args.mask and r["phase"] == args.phase]
        if not rows:
            sys.exit(f"plot.py: no rows of mask {args.mask!r}, phase {args.phase!r} in {args.published}")
        for i, m in enumerate(sorted({r["method"] for r in rows})):
            rs = sorted((r for r in rows if r["method"] == m), key=lambda r: r["cp"])
            c = colours[i % len(colours)]
            ax.plot([r["cp"] for r in rs], [r["predicted_tflops"] for r in rs], "-", color=c, label=f"{m} predicted")
            ax.plot([r["cp"] for r in rs], [r["published_tflops"] for r in rs], "o", color=c, label=f"{m} published")
        ax.set(xlabel="CP size (GPUs)", ylabel="TFLOPS/s per GPU",
               title=f"MagiAttention H100 benchmark, {args.mask} {args.phase}: sp_plan (lines) vs published (dots)")
        n = len(rows)
    else:
        lines = defaultdict(list)
        for path in args.plans:
            with open(path) as f:
                plan = json.load(f)
            world = plan["input"]["world_size"]
            best = {}
            for r in plan["ranked"]:
                fam = family(r)
                if fam is not None and (fam not in best or r["predicted"]["step_s"] < best[fam]):
                    best[fam] = r["predicted"]["step_s"]
            for fam, t in best.items():
                lines[fam].append((world, t * 1e3))
        if not lines:
            sys.exit("plot.py: the --plans hold no configuration over more than one rank")
        for i, (fam, pts) in enumerate(sorted(lines.items())):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", color=colours[i % len(colours)],
                    label=f"{fam} (predicted)")
        n = sum(len(v) for v in lines.values())
        if args.points:
            with open(args.points, newline="") as f:
                pts = list(csv.DictReader(f))
            for i, lab in enumerate(sorted({p["label"] for p in pts})):
                ps = [p for p in pts if p["label"] == lab]
                ax.plot([int(p["world"]) for p in ps], [float(p["value_ms"]) for p in ps], "o",
                        color=colours[(i + len(lines)) % len(colours)], label=lab)
        ax.set(xlabel="CP size (ranks)", ylabel="step time (ms)", title="sp_plan: predicted scaling" +
               (f" ({args.title})" if args.title else ""))
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    save(fig, args.out, args.dpi)
    print(f"plot.py: wrote {args.out} ({n} predicted points)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="?", help="CSV written by scripts/sweep.py")
    ap.add_argument("--plans", nargs="+", help="sp_plan --json files of one problem at several world sizes")
    ap.add_argument("--points", help="CSV world,label,value_ms: measured or published times drawn as markers")
    ap.add_argument("--published", help="JSON written by scripts/sp_plan_published.py --json")
    ap.add_argument("--mask", default="causal", help="with --published: full | causal | varlen_causal")
    ap.add_argument("--attn", help="attention kind to plot (needed when the CSV holds several)")
    ap.add_argument("--out", default="scaling.png", help="PNG to write")
    ap.add_argument("--phase", default="fwd+bwd", choices=["fwd", "bwd", "fwd+bwd"])
    ap.add_argument("--title", default="", help="extra title text (e.g. the machine)")
    ap.add_argument("--dpi", type=int, default=150)
    args = ap.parse_args()
    if args.plans or args.published:
        return plot_scaling(args)
    if not args.csv:
        ap.error("a sweep CSV, --plans or --published is needed")

    attn, rows = load(args.csv, args.attn, args.phase)
    plt.rcParams.update({"font.size": 11, "axes.titlesize": 12, "legend.fontsize": 9})
    algos = sorted({r["algo"] for r in rows if r["algo"] != BASELINE})
    colour = {BASELINE: "black", **{a: f"C{i}" for i, a in enumerate(algos)}}
    seqs = sorted({r["seq"] for r in rows})
    style = {s: LINE_STYLES[i % len(LINE_STYLES)] for i, s in enumerate(seqs)}
    ranks_all = sorted({r["ranks"] for r in rows})
    base = {r["seq"]: r for r in rows if r["algo"] == BASELINE}

    # One line per (algorithm, sequence length), starting at the shared 1-rank baseline.
    lines = defaultdict(list)
    for r in rows:
        if r["algo"] != BASELINE:
            lines[(r["algo"], r["seq"])].append(r)
    for key, rs in lines.items():
        if key[1] in base:
            rs.append(base[key[1]])
        rs.sort(key=lambda r: r["ranks"])
    if not lines:  # only 1-rank runs: show the baseline alone
        for s, b in base.items():
            lines[(BASELINE, s)] = [b]

    fig, axes = plt.subplots(2, 3, figsize=(16, 9.5))
    (ax_t, ax_e, ax_r), (ax_b, ax_x, ax_m) = axes

    def draw(ax, y, err=None):
        """Every line in its algorithm's colour; the shared 1-rank points on top, in black."""
        def one(rs, algo, seq, zorder):
            xs = [r["ranks"] for r in rs]
            ys = [y(r) for r in rs]
            kw = dict(color=colour[algo], ls=style[seq], marker="o", ms=5, lw=1.6, zorder=zorder)
            if err is None:
                ax.plot(xs, ys, **kw)
                return
            lo_hi = [err(r) for r in rs]
            yerr = [[max(0.0, v - lo) for v, (lo, _) in zip(ys, lo_hi)],
                    [max(0.0, hi - v) for v, (_, hi) in zip(ys, lo_hi)]]
            ax.errorbar(xs, ys, yerr=yerr, capsize=3, **kw)
        for (algo, seq), rs in sorted(lines.items()):
            one(rs, algo, seq, 2)
        for seq, b in base.items():
            one([b], BASELINE, seq, 3)

    # Time, with the ideal scaling T1 / P of each sequence length.
    draw(ax_t, lambda r: r["time_ms"], lambda r: (r["tmin"], r["tmax"]))
    for s, b in base.items():
        ax_t.plot(ranks_all, [b["time_ms"] / p for p in ranks_all], color="grey", ls=style[s], lw=1, alpha=0.7)
    ax_t.set(title=f"time ({args.phase}; bars: min-max of iterations)", xlabel="ranks", ylabel="ms")
    ax_t.set_ylim(bottom=0)

    # Efficiency T1 / (P T_P), its bars from the spread of T_P.
    def eff(r, t):
        b = base.get(r["seq"])
        return b["time_ms"] / (r["ranks"] * t) if b else float("nan")
    draw(ax_e, lambda r: eff(r, r["time_ms"]), lambda r: (eff(r, r["tmax"]), eff(r, r["tmin"])))
    ax_e.axhline(1.0, color="grey", lw=1, ls="--")
    top = max([1.1] + [eff(r, r["tmin"]) * 1.05 for rs in lines.values() for r in rs
                       if not math.isnan(eff(r, r["tmin"]))])
    ax_e.set(title="parallel efficiency T1 / (P x T_P)", xlabel="ranks", ylabel="efficiency", ylim=(0, top))

    # Throughput.
    draw(ax_r, lambda r: r["tflops_total"],
         lambda r: (r["flops"] / (r["tmax"] * 1e-3) / 1e12, r["flops"] / (r["tmin"] * 1e-3) / 1e12))
    ax_r.set(title="throughput (all ranks)", xlabel="ranks", ylabel="TFLOP/s")
    ax_r.set_ylim(bottom=0)

    draw(ax_b, lambda r: r["bytes_sent_per_rank"] / 2**20)
    ax_b.set(title="bytes sent per rank (per step)", xlabel="ranks", ylabel="MiB")
    ax_b.set_ylim(bottom=0)

    draw(ax_x, lambda r: r["exposed_comm_pct"])
    ax_x.set(title="exposed communication (mean over ranks)", xlabel="ranks", ylabel="% of the phase time")
    ax_x.set_ylim(bottom=0)

    # Memory per category: stacked bars, one per (rank count, algorithm), at the longest sequence.
    smax = seqs[-1]
    bars = sorted([r for r in rows if r["seq"] == smax], key=lambda r: (r["ranks"], r["algo"] != BASELINE, r["algo"]))
    hatch = ["", "//", "..", "xx", "\\\\"]
    for i, r in enumerate(bars):
        bottom = 0.0
        for j, (cat, _) in enumerate(MEM_CATEGORIES):
            v = num(r.get(f"mem_{cat}_mib")) or 0.0
            ax_m.bar(i, v, bottom=bottom, color=colour[r["algo"]], alpha=0.35 + 0.13 * j, hatch=hatch[j],
                     edgecolor="white", lw=0.5)
            bottom += v
        est = num(r.get("mem_estimate_mib"))
        if est:
            ax_m.plot([i - 0.4, i + 0.4], [est, est], color="red", lw=1.5)
    ax_m.set_xticks(range(len(bars)))
    ax_m.set_xticklabels([f"{r['algo']}\nP={r['ranks']}" for r in bars], fontsize=8)
    ax_m.set(title=f"peak memory per rank, S={fmt_seq(smax)} (red: estimate)", ylabel="MiB")
    ax_m.set_ylim(bottom=0)
    ax_m.legend([plt.Rectangle((0, 0), 1, 1, facecolor="grey", alpha=0.35 + 0.13 * j, hatch=hatch[j])
                 for j in range(len(MEM_CATEGORIES))], [short for _, short in MEM_CATEGORIES], fontsize=8,
                loc="upper right")

    for a in (ax_t, ax_e, ax_r, ax_b, ax_x):
        a.grid(True, alpha=0.3)
        a.set_xscale("log", base=2)
        a.set_xticks(ranks_all)
        a.set_xticklabels([str(p) for p in ranks_all])
        a.minorticks_off()
    # One legend for the figure: colours are algorithms, line styles sequence lengths.
    handles = [Line2D([], [], color=colour[a], marker="o", lw=2, label=a) for a in [BASELINE] + algos]
    handles += [Line2D([], [], color="grey", ls=style[s], lw=1.5, label=f"S={fmt_seq(s)}") for s in seqs]
    handles.append(Line2D([], [], color="grey", lw=1, alpha=0.7, label="ideal T1 / P"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)

    r0 = rows[0]
    over = any(str(r.get("oversubscribed", "0")) == "1" for r in rows)
    fig.suptitle(f"seqpar sp_bench, {attn} ({r0.get('mode', 'train')}): {r0.get('shape', '')}, {r0['layout']}, "
                 f"{r0['dtype']}, {r0['threads']} thread(s)/rank"
                 f"{', host ' + r0['host'] if r0.get('host') else ''}"
                 f"{' (oversubscribed runs)' if over else ''}" + (f"\n{args.title}" if args.title else ""),
                 fontsize=13)
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
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
    print(f"plot.py: wrote {args.out} ({attn}, {len(rows)} rows, phase {args.phase}, ranks {ranks_all})",
          file=sys.stderr)


if __name__ == "__main__":
    main()
