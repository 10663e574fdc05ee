#!/usr/bin/env python3
"""Wave 24's H100 A/B of the L2 evict_first patch (../2026-12-06-wave24/l2_hint/), fp8 and int4 (the formats the
patch's objects changed), sorted by the case's bytes read (codes, scales, sink) against the card's L2.

usage: by_size.py [DIR] [L2_MIB]   (defaults: the wave-24 H100 run, 50 MiB)"""
import collections
import json
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
d = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "2026-12-06-wave24", "l2_hint")
l2_mib = float(sys.argv[2]) if len(sys.argv) > 2 else 50.0
res = collections.defaultdict(dict)
for arm in ("kvq_base", "kvq"):
    for r in (1, 2):
        for row in json.load(open(os.path.join(d, f"ab_{arm}_{r}.json")))["decode"]:
            if row["format"] not in ("fp8_e4m3", "int4"):
                continue
            key = (f"B{row['batch']} Hq{row['num_q_heads']} Hkv{row['num_kv_heads']} D{row['head_dim']} L{row['seq_len']}",
                   row["format"], row["block_size"])
            res[key].setdefault(arm, []).append(row["us_median"])
            res[key]["mib"] = row["kv_bytes"] / 2**20
            res[key]["splits"] = row["splits"]
print(f"{'shape':28s} {'format':9s} {'bs':>2s} {'MiB':>7s} {'x L2':>5s} {'splits':>6s} {'hint/base':>9s}")
wrong = 0
for key, v in sorted(res.items(), key=lambda kv: kv[1]["mib"]):
    ratio = min(v["kvq"]) / min(v["kvq_base"])
    over = v["mib"] > l2_mib
    wrong += (ratio > 1.0) == over and abs(ratio - 1) > 0.005  # the rule (hint where over L2) would lose here
    print(f"{key[0]:28s} {key[1]:9s} {key[2]:2d} {v['mib']:7.1f} {v['mib'] / l2_mib:5.2f} {v['splits']:6d} {ratio:9.3f}")
print(f"cases where 'evict_first iff bytes > L2' picks the slower arm by more than 0.5%: {wrong} of {len(res)}")
