"""paged_decode / paged_prefill on the cpu backend against float64 attention over the values as
stored (decoded independently with ml_dtypes), with interleaved (shuffled) block tables.
Tolerances are the C++ backend tests' (tests/backend/ops_test.cpp): 1e-4 relative L2 for the
output, 2e-4 absolute for the LSE; one wrong token, page or scale costs >= 1e-3."""
import math
import zlib

import numpy as np
import pytest

import kvq
from reference import attention, rel_l2, stored_kv

OUT_BUDGET, LSE_BUDGET = 1e-4, 2e-4
FORMATS = {"fp8": "fp8_e4m3", "fp8_fnuz": "fp8_e4m3_fnuz", "int8": "int8", "bf16": "bf16"}


def filled_cache(rng, dtype, gran, *, heads, dim, block, sink, lens, layers=1):
    pages = sum(-(-n // block) for n in lens) + 8
    cache = kvq.KVCache(dtype, granularity=gran, num_pages=pages, num_kv_heads=heads, head_dim=dim, num_layers=layers,
                        block_size=block, sink_tokens=sink, max_seqs=len(lens) + 1)
    seqs = [cache.add_sequence() for _ in lens]
    done = [0] * len(lens)
    # Grow the sequences a chunk at a time in turn: their pages interleave in the pool.
    while any(d < n for d, n in zip(done, lens)):
        for i in rng.permutation(len(lens)):
            n = min(int(rng.integers(1, 2 * block)), lens[i] - done[i])
            if n <= 0:
                continue
            cache.extend(seqs[i], n)
            sm = cache.slot_mapping(seqs[i], done[i], n)
            for layer in range(layers):
                k = rng.standard_normal((n, heads, dim)).astype(np.float32)
                v = rng.standard_normal((n, heads, dim)).astype(np.float32)
                kvq.reshape_and_cache(k, v, cache, sm, layer)
            done[i] += n
    return cache, seqs


CASES = [
    # dtype, gran, heads, gqa, dim, block, sink, lens
    ("fp8", "per_token_head", 2, 4, 64, 16, 0, [1, 37, 100]),
    ("fp8_fnuz", "per_block_head", 2, 2, 128, 32, 20, [19, 20, 21, 90]),
    ("int8", "per_token_head", 4, 1, 64, 16, 16, [64, 5]),
    ("int8", "per_tensor", 1, 8, 32, 16, 0, [50]),
    ("bf16", "per_token_head", 2, 2, 64, 16, 8, [33, 70]),
]


@pytest.mark.parametrize("dtype,gran,heads,gqa,dim,block,sink,lens", CASES)
def test_paged_decode_matches_float64(dtype, gran, heads, gqa, dim, block, sink, lens):
    rng = np.random.default_rng(zlib.crc32(f"{dtype}{gran}{dim}".encode()))
    cache, seqs = filled_cache(rng, dtype, gran, heads=heads, dim=dim, block=block, sink=sink, lens=lens, layers=2)
    t = cache.batch_tables(seqs)
    q = rng.standard_normal((len(seqs), heads * gqa, dim)).astype(np.float32)
    scale = 1.0 / math.sqrt(dim)
    for layer in range(2):
        out, lse = kvq.paged_decode(q, cache, t["block_tables"], t["seq_lens"], layer,
                                    sink_tables=t["sink_tables"], sink_lens=t["sink_lens"])
        for i in range(len(seqs)):
            k, v = stored_kv(cache, layer, FORMATS[dtype], gran, t["seq_lens"][i], t["sink_lens"][i],
                             t["block_tables"][i], t["sink_tables"][i])
            want, want_lse = attention(q[i], k, v, scale)
            assert rel_l2(out[i], want) <= OUT_BUDGET, f"seq {i} layer {layer}"
            assert np.abs(lse[i] - want_lse).max() <= LSE_BUDGET


def test_decode_notices_a_wrong_page():
    """The comparison above can fail: reading one page of another sequence instead of the right
    one moves the result by far more than the budget. (Swapping two pages of the same sequence
    would not: attention is blind to the order of keys.)"""
    rng = np.random.default_rng(21)
    cache, seqs = filled_cache(rng, "fp8", "per_token_head", heads=2, dim=64, block=16, sink=0, lens=[64, 64])
    t = cache.batch_tables(seqs)
    q = rng.standard_normal((2, 2, 64)).astype(np.float32) * 4
    k, v = stored_kv(cache, 0, "fp8_e4m3", "per_token_head", 64, 0, t["block_tables"][0], [])
    want, _ = attention(q[0], k, v, 1 / 8)
    good, _ = kvq.paged_decode(q, cache, t["block_tables"], t["seq_lens"])
    assert rel_l2(good[0], want) <= OUT_BUDGET
    wrong = t["block_tables"].copy()
    wrong[0, 1] = t["block_tables"][1, 1]
    bad, _ = kvq.paged_decode(q, cache, wrong, t["seq_lens"])
    assert rel_l2(bad[0], want) > 1e-3


@pytest.mark.parametrize("dtype,gran,sink,q_pos0,n_q", [
    ("fp8", "per_token_head", 0, 0, 40),
    ("int8", "per_block_head", 16, 30, 25),
    ("fp8_fnuz", "per_token_head", 24, 10, 7),
])
def test_paged_prefill_matches_float64(dtype, gran, sink, q_pos0, n_q):
    rng = np.random.default_rng(31)
    heads, gqa, dim = 2, 2, 64
    cache, seqs = filled_cache(rng, dtype, gran, heads=heads, dim=dim, block=16, sink=sink, lens=[q_pos0 + n_q, 30])
    t = cache.batch_tables(seqs[:1])
    q = rng.standard_normal((n_q, heads * gqa, dim)).astype(np.float32)
    out, lse = kvq.paged_prefill(q, cache, t["block_tables"], t["seq_lens"], q_pos0,
                                 sink_tables=t["sink_tables"], sink_lens=t["sink_lens"])
    k, v = stored_kv(cache, 0, FORMATS[dtype], gran, t["seq_lens"][0], t["sink_lens"][0], t["block_tables"][0],
                     t["sink_tables"][0])
    for j in range(n_q):
        want, want_lse = attention(q[j], k, v, 1 / 8, causal_len=q_pos0 + j + 1)
        assert rel_l2(out[j], want) <= OUT_BUDGET, f"query {j}"
        assert np.abs(lse[j] - want_lse).max() <= LSE_BUDGET
