"""The ops on torch CUDA tensors (skipped without torch, a GPU, or a package built with
KVQ_CUDA=ON): torch custom ops on the current stream, checked against
torch.nn.functional.scaled_dot_product_attention over the dequantized pages, bit-exact codes
against the cpu backend, CUDA-graph capture and torch.compile."""
import math

import numpy as np
import pytest

import kvq

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and kvq.has_cuda),
                                reason="needs torch with a CUDA GPU and kvq built with KVQ_CUDA=ON")

HEADS, GQA, DIM, BLOCK = 4, 4, 128, 16


def filled(device, dtype="fp8", gran="per_token_head", sink=0, lens=(37, 300, 129), seed=0, poison=True):
    """A cache on `device` written with the same random K/V as every other call with this seed."""
    rng = np.random.default_rng(seed)
    pages = sum(-(-n // BLOCK) for n in lens) + 4
    cache = kvq.KVCache(dtype, granularity=gran, num_pages=pages, num_kv_heads=HEADS, head_dim=DIM,
                        block_size=BLOCK, sink_tokens=sink, max_seqs=len(lens), device=device)
    if poison and cache.is_cuda and cache.key_cache().dtype == torch.uint8:
        # Unwritten memory must never be read: fill the code planes with a byte that decodes to a
        # large value (NaN for OCP) so a stray read shows in the comparison.
        cache.key_cache().fill_(0x7F)
        cache.value_cache().fill_(0x7F)
    seqs = [cache.add_sequence() for _ in lens]
    done = [0] * len(lens)
    while any(d < n for d, n in zip(done, lens)):
        for i in rng.permutation(len(lens)):
            n = min(int(rng.integers(1, 40)), lens[i] - done[i])
            if n <= 0:
                continue
            cache.extend(seqs[i], n)
            k = rng.standard_normal((n, HEADS, DIM)).astype(np.float32)
            v = rng.standard_normal((n, HEADS, DIM)).astype(np.float32)
            slots = cache.slot_mapping(seqs[i], done[i], n)
            if cache.is_cuda:
                k, v, slots = (torch.from_numpy(a).cuda() for a in (k, v, slots))
            kvq.reshape_and_cache(k, v, cache, slots)
            done[i] += n
    return cache, seqs


def cuda_tables(cache, seqs):
    return {k: torch.from_numpy(v).cuda() for k, v in cache.batch_tables(seqs).items()}


def sdpa_reference(cache, seqs, q):
    """Per sequence: SDPA (float64) over the pages as stored, dequantized by kvq.dequantize_pages."""
    t = cache.batch_tables(seqs)
    outs = []
    for i in range(len(seqs)):
        n, sink = int(t["seq_lens"][i]), int(t["sink_lens"][i])
        parts = []
        if sink:
            sk, sv = kvq.dequantize_pages(cache, t["sink_tables"][i][t["sink_tables"][i] >= 0], sink=True)
            parts.append((sk, sv, sink))
        mk, mv = kvq.dequantize_pages(cache, t["block_tables"][i][t["block_tables"][i] >= 0])
        parts.append((mk, mv, n - sink))
        ks = [torch.from_numpy(k).permute(1, 0, 2, 3).reshape(HEADS, -1, DIM)[:, :m] for k, _, m in parts]
        vs = [torch.from_numpy(v).permute(1, 0, 2, 3).reshape(HEADS, -1, DIM)[:, :m] for _, v, m in parts]
        k = torch.cat(ks, 1).double().repeat_interleave(GQA, 0).cuda()
        v = torch.cat(vs, 1).double().repeat_interleave(GQA, 0).cuda()
        qi = q[i].double().unsqueeze(1)  # [Hq, 1, D]
        outs.append(torch.nn.functional.scaled_dot_product_attention(qi, k, v).squeeze(1))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype,gran,sink", [("fp8", "per_token_head", 0), ("fp8_fnuz", "per_block_head", 32),
                                             ("int8", "per_token_head", 16), ("bf16", "per_token_head", 0)])
def test_decode_matches_sdpa_on_dequantized_pages(dtype, gran, sink):
    cache, seqs = filled("cuda", dtype, gran, sink)
    t = cuda_tables(cache, seqs)
    q = torch.randn(len(seqs), HEADS * GQA, DIM, device="cuda")
    out, lse = kvq.paged_decode(q, cache, t["block_tables"], t["seq_lens"], sink_tables=t["sink_tables"],
                                sink_lens=t["sink_lens"])
    want = sdpa_reference(cache, seqs, q)
    err = ((out.double() - want).norm() / want.norm()).item()
    assert err <= 1e-4, err
    assert torch.isfinite(lse).all()


@pytest.mark.parametrize("dtype,gran,sink", [("fp8", "per_token_head", 0), ("fp8_fnuz", "per_block_head", 24),
                                             ("int8", "per_tensor", 0)])
def test_device_codes_equal_cpu_codes(dtype, gran, sink):
    gpu, seqs = filled("cuda", dtype, gran, sink, seed=5, poison=False)  # unwritten slots compare too
    cpu, seqs_cpu = filled("cpu", dtype, gran, sink, seed=5)
    assert seqs == seqs_cpu
    tg, tc = gpu.batch_tables(seqs), cpu.batch_tables(seqs)
    assert all(np.array_equal(tg[k], tc[k]) for k in tg)
    used = np.unique(tc["block_tables"][tc["block_tables"] >= 0])
    for get in (lambda c: c.key_cache(), lambda c: c.value_cache()):
        assert np.array_equal(get(gpu).cpu().numpy()[used], get(cpu)[used])
    if gpu.key_scales() is not None:
        ks = gpu.key_scales().cpu().numpy()
        want = cpu.key_scales()
        assert np.array_equal(ks.view(np.uint32)[used] if ks.ndim > 1 else ks.view(np.uint32),
                              want.view(np.uint32)[used] if want.ndim > 1 else want.view(np.uint32))


def test_current_stream_and_cuda_graph():
    cache, seqs = filled("cuda")
    t = cuda_tables(cache, seqs)
    q = torch.randn(len(seqs), HEADS * GQA, DIM, device="cuda")
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (plans, workspaces) on the stream that captures
        kvq.paged_decode(q, cache, t["block_tables"], t["seq_lens"], out=out, lse=lse)
    torch.cuda.current_stream().wait_stream(side)
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kvq.paged_decode(q, cache, t["block_tables"], t["seq_lens"], out=out, lse=lse)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    q.mul_(-1.5)  # the graph reads q's memory: new values, new result
    graph.replay()
    torch.cuda.synchronize()
    fresh, _ = kvq.paged_decode(q, cache, t["block_tables"], t["seq_lens"])
    assert torch.equal(out, fresh)


def test_torch_compile():
    cache, seqs = filled("cuda")
    t = cuda_tables(cache, seqs)
    q = torch.randn(len(seqs), HEADS * GQA, DIM, device="cuda")

    def step(x):
        o, _ = kvq.paged_decode(x * 2, cache, t["block_tables"], t["seq_lens"])
        return o + 1

    compiled = torch.compile(step, fullgraph=True)
    assert torch.equal(compiled(q), step(q))


def test_device_checks():
    cache, seqs = filled("cuda", lens=(20,))
    t = cache.batch_tables(seqs)
    with pytest.raises(ValueError, match="is on cpu but must be on cuda:0"):
        kvq.paged_decode(torch.zeros(1, HEADS * GQA, DIM), cache, torch.from_numpy(t["block_tables"]),
                         torch.from_numpy(t["seq_lens"]))
    with pytest.raises(ValueError, match="key must be float32, got bfloat16"):
        kvq.reshape_and_cache(torch.zeros(1, HEADS, DIM, device="cuda", dtype=torch.bfloat16),
                              torch.zeros(1, HEADS, DIM, device="cuda"), cache,
                              torch.zeros(1, dtype=torch.int32, device="cuda"))
