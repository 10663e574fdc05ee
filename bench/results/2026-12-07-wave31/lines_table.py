#!/usr/bin/env python3
"""Issue #9/#10 lines from a device_ab.sh console (one arm or the first arm): per shape, bf16's share of the read
stream, fp8 / int8 share and time over bf16, int4 time over bf16; block 16 / block 32.
Usage: python3 lines_table.py CONSOLE [ARM]   (ARM: the arm's column prefix, default the first)."""
import collections, re, sys

lines = open(sys.argv[1]).read().splitlines()
head = next(i for i, l in enumerate(lines) if l.startswith("shape "))
cols = lines[head].split()
arm = sys.argv[2] if len(sys.argv) > 2 else cols[3][:-3]
rows = collections.defaultdict(dict)
for l in lines[head + 1:]:
    m = re.match(r"^(B\S+ Hq\S+ Hkv\S+ D\S+ L\S+)\s+(\S+)\s+(\d+)\s+(.*)$", l)
    if not m:
        continue
    vals = m.group(4).split()
    names = cols[3:]
    d = dict(zip(names, vals))
    rows[m.group(1)][(m.group(2), int(m.group(3)))] = (float(d[arm + "_us"]), float(d["%read_" + arm]))
print(f"| shape | bf16 % read | fp8 % read, x bf16 | int8 % read, x bf16 | int4 x bf16 |")
print("|---|---|---|---|---|")
for shape, r in rows.items():
    def cell(fmt, with_read):
        out = []
        for bs in (16, 32):
            if (fmt, bs) not in r or ("bf16", bs) not in r:
                out.append("-"); continue
            t, rd = r[(fmt, bs)]
            x = t / r[("bf16", bs)][0]
            out.append((f"{rd:.1f}, {x:.3f}" if with_read else f"{x:.3f}") if fmt != "bf16" else f"{rd:.1f}")
        return " / ".join(out)
    print(f"| {shape} | {cell('bf16', True)} | {cell('fp8_e4m3', True)} | {cell('int8', True)} | {cell('int4', False)} |")
