#!/usr/bin/env python3
"""Wave 26's A/B of the evict_first instances (arms off / ef / auto of device_l2_rule.sh), every 8- and 4-bit case
sorted by the bytes it reads (codes, scales, sink) against the card's L2; bf16 (no such instances: its arms run
the same kernel) gives the noise.

usage: by_size.py DIR L2_MIB   (e.g. h100 50, h200 60)"""
import collections
import json
import os
import sys

d, l2_mib = sys.argv[1], float(sys.argv[2])
res = collections.defaultdict(dict)
for arm in ("off", "ef", "auto"):
    for r in (1, 2):
        for row in json.load(open(os.path.join(d, f"ab_{arm}_{r}.json")))["decode"]:
            key = (f"B{row['batch']} Hq{row['num_q_heads']} Hkv{row['num_kv_heads']} D{row['head_dim']} L{row['seq_len']}",
                   row["format"], row["block_size"])
            res[key].setdefault(arm, []).append(row["us_median"])
            res[key]["mib"] = row["kv_bytes"] / 2**20
            res[key].setdefault("auto_ef", set()).add(bool(row.get("l2_evict_first")) if arm == "auto" else None)
noise = [min(v["ef"]) / min(v["off"]) for k, v in res.items() if k[1] == "bf16"]
print(f"bf16 (same kernel in every arm): ef/off {min(noise):.3f}..{max(noise):.3f} over {len(noise)} cases")
print(f"{'shape':28s} {'format':9s} {'bs':>2s} {'MiB':>7s} {'x L2':>5s} {'ef/off':>7s} {'auto/off':>8s} {'auto ef':>7s}")
wrong = collections.Counter()
total = collections.Counter()
for key, v in sorted(res.items(), key=lambda kv: kv[1]["mib"]):
    if key[1] == "bf16":
        continue
    ef, auto = min(v["ef"]) / min(v["off"]), min(v["auto"]) / min(v["off"])
    over = v["mib"] > l2_mib
    total[key[1]] += 1
    wrong[key[1]] += (ef > 1.0) == over and abs(ef - 1) > 0.005  # 'evict_first iff bytes > L2' picks the slower arm
    chosen = "yes" if True in v["auto_ef"] else "no"
    print(f"{key[0]:28s} {key[1]:9s} {key[2]:2d} {v['mib']:7.1f} {v['mib'] / l2_mib:5.2f} {ef:7.3f} {auto:8.3f} {chosen:>7s}")
for f in total:
    print(f"{f}: 'evict_first iff bytes > L2' picks the slower arm by more than 0.5% in {wrong[f]} of {total[f]} cases")
