# Summarises Nsight Compute source-page exports (SASS, warp-state samples per instruction) of the decode kernels:
# sample shares turned into time per SM sub-partition (share x kernel duration), for the kernel's entry, the
# straight-line code (run <= 3 times a warp: ramp and tail) and the loops, with the instructions that hold most.
import csv, re, sys, collections as C
def num(x):
    try: return float(x)
    except ValueError: return 0.0
for base in sys.argv[1:]:
    with open(base + '_sass.csv') as f:
        r = csv.reader(f); name = next(r)[1]; hdr = next(r)
        rows = [dict(zip(hdr, x)) for x in r if len(x) == len(hdr)]
    det = open(base + '_details.txt').read()
    dur = float(re.search(r'Duration\s+us\s+([\d.]+)', det).group(1))
    reasons = [h for h in hdr if h.startswith('stall_') and '(Not Issued)' not in h]
    tot = sum(num(x['# Samples']) for x in rows)
    ex = [num(x['Instructions Executed']) for x in rows]
    warps = C.Counter(int(e) for e in ex if e > 0).most_common(1)[0][0]
    us = lambda s: s / tot * dur
    print('== %s: %s' % (base.split('/')[-1], re.sub(r'kvq::attention::cuda::detail::', '', name)[:150]))
    print('   duration %.2f us, %d warps, %d samples, %d instructions' % (dur, warps, tot, len(rows)))
    ent = C.Counter()
    for x in rows[:40]:
        for k in reasons: ent[k] += num(x[k])
    print('   entry (first 40 instructions): %.2f us: %s' % (us(sum(ent.values())), ', '.join('%s %.2f' % (k[6:], us(v)) for k, v in ent.most_common(3))))
    once, loop = C.Counter(), C.Counter()
    for x, e in zip(rows, ex):
        tgt = once if e / warps <= 3 else loop
        for k in reasons: tgt[k] += num(x[k])
    print('   straight-line code %.2f us (%s)' % (us(sum(once.values())), ', '.join('%s %.2f' % (k[6:], us(v)) for k, v in once.most_common(5))))
    print('   loops %.2f us (%s)' % (us(sum(loop.values())), ', '.join('%s %.2f' % (k[6:], us(v)) for k, v in loop.most_common(5))))
    top = sorted(((num(x['# Samples']), i) for i, (x, e) in enumerate(zip(rows, ex)) if 0 < e / warps <= 3), reverse=True)[:8]
    print('   straight-line instructions holding most (index, us, runs a warp, reasons, SASS):')
    for s, i in sorted(top, key=lambda t: t[1]):
        x = rows[i]
        rs = sorted(((num(x[k]), k[6:]) for k in reasons), reverse=True)[:2]
        print('     %5d %5.2f %4.2f %-28s %s' % (i, us(s), ex[i] / warps, ' '.join('%s:%.0f' % (k, v) for v, k in rs if v), x['Source'].strip()[:60]))
    print()
