# Where the decode kernels wait on instruction fetch (no_inst), from Nsight Compute source-page exports (SASS with
# warp-state samples per instruction; wave 29's h200_ncu/*_sass.csv.gz, or a later probe's): per kernel, the share
# of samples that are no_inst, in code run at most 3 times a warp (ramp, tail) and in the loops; the bytes of code a
# warp runs every iteration (instructions run >= 3.5 times a warp, in 128-byte lines); the instructions that hold
# the most no_inst, whether a branch lands on them, and what comes just before.
#   python3 fetch_reading.py DIR_OR_FILES...   (*_sass.csv or *_sass.csv.gz; *_details.txt beside them for the duration)
import collections, csv, glob, gzip, io, os, re, sys

def num(x):
    try:
        return float(x)
    except ValueError:
        return 0.0

def load(path):
    f = gzip.open(path, 'rt') if path.endswith('.gz') else open(path)
    r = csv.reader(f)
    name = next(r)[1]
    hdr = next(r)
    rows = [dict(zip(hdr, x)) for x in r if len(x) == len(hdr)]
    return name, rows

paths = []
for a in sys.argv[1:]:
    paths += sorted(glob.glob(os.path.join(a, '*_sass.csv*'))) if os.path.isdir(a) else [a]
for path in paths:
    name, rows = load(path)
    base = re.sub(r'_sass\.csv(\.gz)?$', '', path)
    dur = 0.0
    if os.path.exists(base + '_details.txt'):
        m = re.search(r'Duration\s+us\s+([\d.]+)', open(base + '_details.txt').read())
        dur = float(m.group(1)) if m else 0.0
    ex = [num(x['Instructions Executed']) for x in rows]
    warps = collections.Counter(int(e) for e in ex if e > 0).most_common(1)[0][0]
    runs = [e / warps for e in ex]
    ni = [num(x['stall_no_inst']) for x in rows]
    total = sum(num(x['# Samples']) for x in rows)
    targets = set()
    for x in rows:
        m = re.search(r'\bBRA\s+(0x[0-9a-f]+)', x['Source'])
        if m:
            targets.add(int(m.group(1), 16))
    addr = [int(x['Address'], 16) for x in rows]
    once = sum(n for n, r in zip(ni, runs) if 0 < r <= 3)
    loop = sum(n for n, r in zip(ni, runs) if r > 3)
    hot = [i for i, r in enumerate(runs) if r >= 3.5]
    lines = {addr[i] // 128 for i in hot}
    kernel = re.sub(r'kvq::attention::cuda::detail::|\(kvq::[A-Za-z:]*\)', '', name)[:110]
    print(f"== {os.path.basename(base)}: {kernel}")
    print(f"   {dur:.2f} us, {len(rows)} instructions, max runs a warp {max(runs):.1f}; no_inst {100 * sum(ni) / total:.1f}% of "
          f"samples ({100 * once / total:.1f}% in code run <= 3 times a warp, {100 * loop / total:.1f}% in loops); "
          f"code run every iteration: {len(lines) * 128 / 1024:.1f} KB in {len(lines)} lines")
    top = sorted(range(len(rows)), key=lambda i: -ni[i])[:8]
    for i in sorted(top):
        if ni[i] <= 0:
            continue
        prev = rows[i - 1]['Source'].strip()[:40] if i else ''
        us = ni[i] / total * dur
        print(f"   {i:6d} {us:5.2f} us ({100 * ni[i] / total:4.1f}%) runs {runs[i]:5.2f} "
              f"{'branch target' if addr[i] in targets else 'falls through':13s} {rows[i]['Source'].strip()[:34]:34s} after: {prev}")
    print()
