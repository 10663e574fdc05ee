#!/usr/bin/env python3
"""Table of device_near_line_sweep.sh: per shape and format, the median time (us) of every run (splitN_auto: N forced
splits, 0 = the plan's, with the plan's L2 choice; splitN_off: plain copies; stagesN_auto: ring depth N), the
plan's splits and L2 choice, and the best run against the plan's (split0_auto). usage: sweep_table.py DIR"""
import collections, glob, json, os, sys

d = sys.argv[1]
res, meta = collections.defaultdict(dict), {}
names = []
for path in sorted(glob.glob(os.path.join(d, "*.json")), key=os.path.getmtime):
    name = os.path.basename(path)[:-5]
    names.append(name)
    for row in json.load(open(path))["decode"]:
        key = (f"B{row['batch']} Hq{row['num_q_heads']} Hkv{row['num_kv_heads']} D{row['head_dim']} L{row['seq_len']}",
               row["format"])
        res[key][name] = (row["us_median"], row["splits"], row["ring_stages"], row.get("l2_evict_first"), row["frac_of_read"])
for key, runs in res.items():
    base = runs.get("split0_auto")
    print(f"{key[0]} {key[1]}: plan splits {base[1] if base else '?'} stages {base[2] if base else '?'} ef {base[3] if base else '?'}")
    for name in names:
        if name in runs:
            us, splits, stages, ef, frac = runs[name]
            rel = us / base[0] if base else 0
            print(f"   {name:16s} {us:8.1f} us  {rel:6.3f}  splits {splits:3d} stages {stages:2d} ef {int(bool(ef))} %read {100 * frac:5.1f}")
    best = min(runs.items(), key=lambda kv: kv[1][0])
    if base:
        print(f"   best: {best[0]} {best[1][0]:.1f} us = {best[1][0] / base[0]:.3f} of the plan's")
