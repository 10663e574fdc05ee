#!/usr/bin/env python3
"""SASS instructions and registers per kernel instance of two cubins, matched by name with the L2 policy argument
dropped (wave 26: main's decode_inst_int4 vs this wave's, and this wave's default vs evict_first instances).
Usage: sass_by_instance.py A.cubin B.cubin  (cuobjdump and nvdisasm on PATH: pip download nvidia-cuda-cuobjdump
nvidia-cuda-nvdisasm, unzip). Prints, per instance, A's and B's instruction counts, B/A - 1, registers, and whether
the instruction text is the same (branch targets included)."""
import re, subprocess, sys


def sass(cubin):
    text = subprocess.run(["cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    res = subprocess.run(["cuobjdump", "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    funcs, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            cur = m.group(1)
            funcs[cur] = []
            continue
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(.*?);", line)
        if m and cur:
            funcs[cur].append(m.group(1))
    regs, cur = {}, None
    for line in res.splitlines():
        m = re.search(r"Function (\S+):", line)
        if m:
            cur = m.group(1)
        m = re.search(r"REG:(\d+)", line)
        if m and cur:
            regs[cur] = int(m.group(1))
    names = list(funcs)
    plain = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    out = {}
    for mangled, name in zip(names, plain):
        name = re.sub(r", \(kvq::attention::cuda::detail::L2Policy\)\d", "", name)
        out[name] = (funcs[mangled], regs.get(mangled))
    return out


a, b = sass(sys.argv[1]), sass(sys.argv[2])
same = 0
for name in sorted(a):
    if name not in b:
        print("only in A:", name)
        continue
    (ia, ra), (ib, rb) = a[name], b[name]
    same += ia == ib
    short = re.sub(r"\((?:kvq::attention::cuda::detail::|kvq::)(\w+)\)(\d)", r"\1=\2", name)
    short = short.replace("kvq::attention::cuda::detail::", "")
    print(f"{len(ia):6d} {len(ib):6d} {len(ib) / len(ia) - 1:+6.1%}  regs {ra}/{rb}  {'same' if ia == ib else 'differs'}  {short}")
print(f"{same} of {len(a)} instances with the same instruction text")
