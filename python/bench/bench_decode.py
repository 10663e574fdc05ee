"""Times kvq.paged_decode from Python (torch CUDA tensors, replayed in a CUDA graph, cold L2) on
the shapes of `kvq bench decode`, to compare with the C++ number: the binding should add nothing
to the kernel's time (no copies, no syncs). A benchmark, not a test.

    KVQ_CUDA=ON pip install ./python && python python/bench/bench_decode.py --shapes "64,32,8,128,4096;16,64,8,128,16384"
    kvq bench decode --backend cuda --kv-cache-dtype fp8 --shapes "64,32,8,128,4096;16,64,8,128,16384"
"""
import argparse

import numpy as np
import torch

import kvq


def fill(cache, seqs, length, heads, dim):
    g = torch.Generator(device="cuda").manual_seed(0)
    chunk = 2048
    for s in seqs:
        cache.extend(s, length)
        for p in range(0, length, chunk):
            n = min(chunk, length - p)
            k = torch.randn(n, heads, dim, device="cuda", generator=g)
            v = torch.randn(n, heads, dim, device="cuda", generator=g)
            kvq.reshape_and_cache(k, v, cache, torch.from_numpy(cache.slot_mapping(s, p, n)).cuda())


def bench(shape, dtype, gran, iters, warmup):
    b, hq, hkv, d, length = shape
    bs = 16
    cache = kvq.KVCache(dtype, granularity=gran, num_pages=b * -(-length // bs), num_kv_heads=hkv, head_dim=d,
                        block_size=bs, sink_tokens=0, device="cuda")
    seqs = [cache.add_sequence() for _ in range(b)]
    fill(cache, seqs, length, hkv, d)
    t = {k: torch.from_numpy(v).cuda() for k, v in cache.batch_tables(seqs).items()}
    q = torch.randn(b, hq, d, device="cuda")
    out, lse = torch.empty_like(q), torch.empty(b, hq, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kvq.paged_decode(q, cache, t["block_tables"], t["seq_lens"], out=out, lse=lse)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kvq.paged_decode(q, cache, t["block_tables"], t["seq_lens"], out=out, lse=lse)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    flush = torch.empty(max(2 * l2, 1 << 20), dtype=torch.uint8, device="cuda")
    times = []
    for i in range(warmup + iters):
        flush.zero_()  # cold L2, as `kvq bench decode` (default) measures
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) * 1e3)
    kv_bytes = b * length * cache.bytes_per_token
    med = float(np.median(times))
    print(f"B={b} Hq={hq} Hkv={hkv} D={d} L={length} {cache.spec}: median {med:.1f} us, "
          f"min {min(times):.1f} us, {kv_bytes / med / 1e3:.0f} GB/s of KV")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="64,32,8,128,4096;16,64,8,128,16384", help="B,Hq,Hkv,D,L;...")
    ap.add_argument("--kv-cache-dtype", default="fp8")
    ap.add_argument("--granularity", default="per_token_head")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    a = ap.parse_args()
    for s in a.shapes.split(";"):
        bench(tuple(int(x) for x in s.split(",")), a.kv_cache_dtype, a.granularity, a.iters, a.warmup)


if __name__ == "__main__":
    main()
