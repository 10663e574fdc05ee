#!/usr/bin/env python3
"""Compares `kvq eval --json` results spec by spec: perplexity, its change vs each run's own bf16
baseline (dPPL) and mean KL, against the first file given, which is the reference.

    python3 scripts/compare_evals.py REF.json OTHER.json [MORE.json ...]

Missing files are skipped with a note (a device run may not have produced every eval). For each
other run, per spec: ppl relative difference (%) and dPPL difference in percentage points, the two
quantities of issue 7's CPU-vs-CUDA accuracy line (0.2% and 0.05 pp). Exit 0 always: a report.
"""
import json
import os
import sys


def load(path):
    with open(path) as f:
        d = json.load(f)
    rows = {}
    for r in d["results"]:
        if r.get("error"):
            continue
        rows[r["label"].replace(" (baseline)", "")] = r
    return d, rows


def describe(d, path):
    cmd = d.get("command", "")
    be = "cuda" if "--backend cuda" in cmd else "cpu" if "--backend cpu" in cmd else "?"
    num = "reproducible" if "--numerics reproducible" in cmd else "fast"
    w = "fp32" if "--weights fp32" in cmd or num == "reproducible" or be == "cpu" else "bf16"
    return f"{be}/{num}/w{w} ({os.path.basename(path)})"


def main(argv):
    paths = [p for p in argv[1:] if os.path.exists(p)]
    for p in argv[1:]:
        if not os.path.exists(p):
            print(f"(skipped, not found: {p})")
    if len(paths) < 2:
        print("compare_evals: need a reference and at least one other existing file")
        return 0
    ref_d, ref = load(paths[0])
    print(f"reference: {describe(ref_d, paths[0])}")
    for p in paths[1:]:
        d, rows = load(p)
        print(f"\n{describe(d, p)} vs reference")
        print("| spec | ppl ref | ppl | ppl diff | dPPL ref | dPPL | dPPL diff (pp) | KL ref | KL |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        worst_ppl = worst_dppl = 0.0
        for label, r0 in ref.items():
            r = rows.get(label)
            if r is None:
                continue
            rel = (r["ppl"] / r0["ppl"] - 1) * 100
            dd = r["delta_ppl_pct"] - r0["delta_ppl_pct"]
            worst_ppl, worst_dppl = max(worst_ppl, abs(rel)), max(worst_dppl, abs(dd))
            print(f"| {label} | {r0['ppl']:.4f} | {r['ppl']:.4f} | {rel:+.4f}% | {r0['delta_ppl_pct']:+.3f}% | "
                  f"{r['delta_ppl_pct']:+.3f}% | {dd:+.4f} | {r0['kl_mean']:.3e} | {r['kl_mean']:.3e} |")
        print(f"largest |ppl diff| {worst_ppl:.4f}% (line: 0.2%), largest |dPPL diff| {worst_dppl:.4f} pp (line: 0.05 pp)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
