#!/usr/bin/env python3
"""The attention step (`kvq bench decode --with-write`: a one-token write per sequence, then the decode, one graph)
per arm of scripts/device_ab.sh: best round's step, write and decode medians (us) per arm, and the step of each arm
over the first arm's. usage: step_table.py DIR ROUNDS ARM..."""
import collections, json, sys

out, rounds, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
res = collections.defaultdict(lambda: collections.defaultdict(list))
for n in names:
    for r in range(1, rounds + 1):
        for row in json.load(open(f"{out}/ab_{n}_{r}.json"))["decode"]:
            if not row.get("step_us"):
                continue
            key = (f"B{row['batch']} Hq{row['num_q_heads']} Hkv{row['num_kv_heads']} D{row['head_dim']} L{row['seq_len']}",
                   row["format"], row["block_size"])
            res[key][n].append((row["step_us"], row["write_us"], row["us_median"], row.get("overlap_previous")))
base = names[0]
print(f"{'shape':30s} {'format':9s} bs " + " ".join(f"{n + ' step/write/decode':>26s}" for n in names) + "  " +
      " ".join(f"{n + '/' + base:>12s}" for n in names[1:]) + "  saved_us")
for key, v in res.items():
    if any(n not in v for n in names):
        continue
    best = {n: min(v[n]) for n in names}  # the round with the shortest step
    print(f"{key[0]:30s} {key[1]:9s} {key[2]:2d} " +
          " ".join(f"{best[n][0]:8.2f} {best[n][1]:7.2f} {best[n][2]:8.2f}{'*' if best[n][3] else ' '}" for n in names) + "  " +
          " ".join(f"{best[n][0] / best[base][0]:12.3f}" for n in names[1:]) + "  " +
          " ".join(f"{best[base][0] - best[n][0]:8.2f}" for n in names[1:]))
print("* the decode launched as a programmatic dependent of the write (DecodePlan::overlap_previous)")
