#!/usr/bin/env python3
"""Latency CDFs of `kvq bench serve` results: one row of panels per tier (TTFT, TPOT), one line per run.

    scripts/plot_serve_cdf.py OUT.png RUN.json [RUN.json ...]

Needs matplotlib (PyPI); prints a one-line hint and exits 1 without it.
"""
import json
import sys


def main():
    if len(sys.argv) < 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_serve_cdf: matplotlib is missing; `python3 -m pip install matplotlib`", file=sys.stderr)
        return 1
    runs = []
    for path in sys.argv[2:]:
        with open(path) as f:
            runs.append(json.load(f))
    tiers = max(len(r["tiers"]) for r in runs)
    fig, axes = plt.subplots(tiers, 2, figsize=(10, 3.2 * tiers), squeeze=False)
    for t in range(tiers):
        for col, (key, name) in enumerate([("ttft_s", "TTFT"), ("tpot_s", "TPOT")]):
            ax = axes[t][col]
            for r in runs:
                if t >= len(r["tiers"]):
                    continue
                tier = r["tiers"][t]
                xs = sorted(1e3 * q[key] for q in tier.get("requests_detail", []) if q["ok"] and q[key] > 0)
                if not xs:
                    continue
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=r.get("label", "?"))
            ax.set_title(f"{name}, prompts of ~{runs[0]['tiers'][t]['prompt_tokens_target']} tokens")
            ax.set_xlabel(f"{name} (ms)")
            ax.set_ylabel("fraction of requests")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[1], dpi=110)
    print(f"wrote {sys.argv[1]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
