# Static reading of the decode kernels' sm_90a SASS (no GPU needed): per product instance of decode_bulk_kernel,
# its size, and its loops -- a backward branch that is not the retry stub of an mbarrier wait -- that hold both an
# mbarrier wait and an mma (the sink-tile loops and the page loops, one pair per scale dtype x layout variant),
# with their spans in instructions and KB (16 bytes an instruction).
#   python3 sass_loops.py OBJ.cu.o...   (CUOBJDUMP: the cuobjdump to use; default: the one on PATH)
import os, re, subprocess, sys
CUO = os.environ.get('CUOBJDUMP', 'cuobjdump')
FORMATS = {'0': 'bf16', '1': 'fp16', '2': 'fp8', '3': 'fnuz', '4': 'int8', '5': 'int4'}

def functions(obj):
    out = subprocess.run([CUO, '-sass', obj], capture_output=True, text=True, check=True).stdout
    fn, ins = None, []
    for line in out.splitlines():
        m = re.search(r'Function : (\S+)', line)
        if m:
            if fn:
                yield fn, ins
            fn, ins = m.group(1), []
            continue
        m = re.match(r'\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;', line)
        if m and fn:
            ins.append((int(m.group(1), 16), m.group(2)))
    if fn:
        yield fn, ins

def instance(mangled):
    m = re.search(r'FormatE(\d)ELi(\d+)ELNS2_9ScaleModeE(\d)ELi(\d)ELNS2_4FeedE(\d)ELb(\d)ELb(\d)ELNS2_8L2PolicyE(\d)', mangled)
    if not m:
        return None
    f, d, sm, ctas, feed, pack, tl, l2 = m.groups()
    return (f"{FORMATS[f]} D{d} scales{sm} ctas{ctas} {'producer' if feed == '1' else 'self'} pack{pack} "
            f"timeline{tl} {'evict_first' if l2 == '1' else 'normal'}")

def page_loops(ins):
    at = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (a, text) in enumerate(ins):
        m = re.search(r'\bBRA\s+(?:`\()?0x([0-9a-f]+)', text)
        if not m:
            continue
        target = int(m.group(1), 16)
        retry_stub = any('SYNCS.PHASECHK' in ins[j][1] for j in (i - 1, i - 2) if j >= 0)
        if target <= a and target in at and not retry_stub:
            loops.append((at[target], i))
    found = [(s, e) for s, e in loops
             if any('SYNCS.PHASECHK' in t for _, t in ins[s:e + 1]) and any('HMMA' in t for _, t in ins[s:e + 1])]
    return sorted((s, e) for s, e in found
                  if not any(s2 <= s and e <= e2 and (s2, e2) != (s, e) for s2, e2 in found))

seen = set()
for obj in sys.argv[1:]:
    for fn, ins in functions(obj):
        name = instance(fn)
        if not name or name in seen:
            continue
        seen.add(name)
        loops = ', '.join(f"{s}-{e} ({e - s + 1}, {(e - s + 1) * 16 / 1024:.1f})" for s, e in page_loops(ins))
        print(f"{name:58s} {len(ins):6d} instr {len(ins) * 16 / 1024:6.1f} KB | loops (instr, KB): {loops}")
