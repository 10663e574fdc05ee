"""KVCache: geometry, bytes per token, and quantize-on-write codes and scales checked bit for bit
against an independent numpy model of the writer (tests/reference.py)."""
import zlib

import numpy as np
import pytest

import kvq
from reference import CacheModel

FORMATS = {"fp8": "fp8_e4m3", "fp8_fnuz": "fp8_e4m3_fnuz", "int8": "int8", "bf16": "bf16"}
GRANS = ["per_token_head", "per_block_head", "per_tensor"]


def make_cache(dtype, gran, *, heads=2, dim=16, block=16, sink=0, pages=24, layers=1, sink_pages=None):
    return kvq.KVCache(dtype, granularity=gran, num_pages=pages, num_kv_heads=heads, head_dim=dim,
                       num_layers=layers, block_size=block, sink_tokens=sink, num_sink_pages=sink_pages, max_seqs=4)


@pytest.mark.parametrize("dtype,bits", [("fp8", 8), ("int8", 8), ("bf16", 16)])
@pytest.mark.parametrize("gran", GRANS)
def test_geometry_and_bytes_per_token(dtype, bits, gran):
    c = make_cache(dtype, gran, heads=4, dim=64, block=32, layers=3)
    g = c.geometry
    assert (g["num_layers"], g["num_kv_heads"], g["head_dim"], g["block_size"], g["num_pages"]) == (3, 4, 64, 32, 24)
    scales = {"per_token_head": 4 * 32, "per_block_head": 4, "per_tensor": 0}[gran] if bits == 8 else 0
    per_page = 3 * 2 * (4 * 32 * 64 * bits // 8 + scales * 4)
    assert c.bytes_per_token == -(-per_page // 32)
    assert c.bytes_per_page == per_page
    assert c.key_cache(2).shape == (24, 4, 32, 64)
    assert c.key_cache(0).dtype == (np.uint8 if bits == 8 else np.uint16)
    if bits == 16:
        assert c.key_scales(0) is None


def shuffled_sequences(cache, rng, lens):
    """Sequences whose pages interleave (grown a few tokens at a time in random order), so block
    tables are neither contiguous nor sorted. Returns {seq: target length}."""
    seqs = {cache.add_sequence(): n for n in lens}
    # A throwaway sequence takes and frees pages in between, so reuse scrambles the free list too.
    junk = cache.add_sequence()
    cache.extend(junk, 3 * cache.geometry["block_size"])
    cache.free(junk)
    return seqs


def grow_and_write(cache, model, rng, seqs, steps, layer=0):
    """Appends tokens to every sequence over `steps` batched writes (one reshape_and_cache call
    each, rows of several sequences in random order); mirrors each call in the model."""
    g = cache.geometry
    done = {s: 0 for s in seqs}
    for step in range(steps):
        order = list(seqs)
        rng.shuffle(order)
        slots, rows = [], []
        for s in order:
            left = seqs[s] - done[s]
            # Every sequence grows in every step (so their pages interleave), the last step finishes.
            n = left if step == steps - 1 else min(left, int(rng.integers(4, 17)))
            if n == 0:
                continue
            cache.extend(s, n)
            slots.append(cache.slot_mapping(s, done[s], n))
            # Scales differ per row so per_token_head and per_block_head growth are exercised.
            rows.append(rng.standard_normal((n, g["num_kv_heads"], g["head_dim"])).astype(np.float32)
                        * rng.uniform(0.1, 8.0, (n, 1, 1)).astype(np.float32))
            done[s] += n
        if not slots:
            continue
        slot_mapping = np.concatenate(slots)
        k = np.concatenate(rows)
        v = (k * np.float32(-0.5) + np.float32(0.25)).astype(np.float32)
        kvq.reshape_and_cache(k, v, cache, slot_mapping, layer)
        model.write(slot_mapping, k, v)


@pytest.mark.parametrize("dtype", list(FORMATS))
@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("sink", [0, 20])
def test_quantize_on_write_matches_reference(dtype, gran, sink):
    rng = np.random.default_rng(zlib.crc32(f"{dtype}{gran}{sink}".encode()))
    cache = make_cache(dtype, gran, sink=sink, heads=2, dim=16)
    g = cache.geometry
    model = CacheModel(FORMATS[dtype], gran, g["num_pages"], g["num_sink_pages"], 2, g["block_size"], 16)
    seqs = shuffled_sequences(cache, rng, [70, 33, 51])
    grow_and_write(cache, model, rng, seqs, steps=6)
    tables = cache.batch_tables(list(seqs))
    assert not all(np.all(np.diff(row[row >= 0]) == 1) for row in tables["block_tables"]), "tables should interleave"
    for kv, (codes, scales) in enumerate([(cache.key_cache(), cache.key_scales()), (cache.value_cache(), cache.value_scales())]):
        bad = np.argwhere(codes != model.codes[kv])
        assert bad.size == 0, f"{'KV'[kv]} codes differ at {bad[:4].tolist()}: {codes[tuple(bad[0])]} vs {model.codes[kv][tuple(bad[0])]}"
        if scales is not None:
            assert np.array_equal(scales.view(np.uint32), model.scales[kv].view(np.uint32)), f"{'KV'[kv]} scales differ"
    if sink:
        assert np.array_equal(cache.key_sink(), model.sink[0]) and np.array_equal(cache.value_sink(), model.sink[1])
    if gran == "per_block_head" and dtype != "bf16":
        assert cache.stats()["requantized_page_heads"] > 0, "the writes should have grown some page scales"


@pytest.mark.parametrize("dtype", ["fp8", "fp8_fnuz", "int8"])
def test_dequantize_pages_is_code_times_scale(dtype):
    rng = np.random.default_rng(11)
    cache = make_cache(dtype, "per_token_head", sink=16)
    g = cache.geometry
    model = CacheModel(FORMATS[dtype], "per_token_head", g["num_pages"], g["num_sink_pages"], 2, 16, 16)
    seqs = shuffled_sequences(cache, rng, [40])
    grow_and_write(cache, model, rng, seqs, steps=2)
    pages = cache.batch_tables(list(seqs))["block_tables"][0]
    k, v = kvq.dequantize_pages(cache, pages)
    dec = kvq.fp8_decode if dtype != "int8" else None
    for x, codes, scales in ((k, cache.key_cache(), cache.key_scales()), (v, cache.value_cache(), cache.value_scales())):
        raw = codes[pages]
        vals = (dec(raw, dtype) if dec else raw.view(np.int8).astype(np.float32))
        assert np.array_equal(x, vals * scales[pages][..., None])
    ks, _ = kvq.dequantize_pages(cache, cache.batch_tables(list(seqs))["sink_tables"][0], sink=True)
    assert ks.shape == (1, 2, 16, 16)
    assert np.array_equal(ks[0], kvq.decode(cache.key_sink()[cache.batch_tables(list(seqs))["sink_tables"][0][0]], "bf16"))


def test_dequantize_pages_applies_int4_outlier_channel_scales_and_entries():
    # int4_outlier keeps K per channel (scales in its side plane, from the running statistics that the
    # sink rows start) and values beyond the grid as fp16 entries: the main pages read back near the
    # written values (int4 noise; read as code x 1 they would be ~3x off), the spikes to fp16 precision.
    rng = np.random.default_rng(13)
    cache = make_cache("int4_outlier", "per_token_head", dim=64, sink=16)
    s = cache.add_sequence()
    n = 16 + 32
    cache.extend(s, n)
    k = rng.standard_normal((n, 2, 64)).astype(np.float32)
    k[:, :, 5] += 6.0  # a channel that is large in every token
    v = rng.standard_normal((n, 2, 64)).astype(np.float32)
    k[23, 1, 20] = 40.0  # spikes: sparse entries
    v[35, 0, 3] = -35.0
    kvq.reshape_and_cache(k, v, cache, cache.slot_mapping(s, 0, n))
    pages = cache.batch_tables([s])["block_tables"][0][:2]
    kd, vd = kvq.dequantize_pages(cache, pages)
    got_k = kd.transpose(0, 2, 1, 3).reshape(32, 2, 64)
    got_v = vd.transpose(0, 2, 1, 3).reshape(32, 2, 64)
    for got, want in ((got_k, k[16:]), (got_v, v[16:])):
        assert np.all(np.isfinite(got))
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.25
    assert abs(got_k[7, 1, 20] - 40.0) < 0.05 and abs(got_v[19, 0, 3] + 35.0) < 0.05


def test_fork_shares_pages_and_writes_stay_private():
    rng = np.random.default_rng(12)
    cache = make_cache("fp8", "per_token_head")
    a = cache.add_sequence()
    cache.extend(a, 20)
    k = rng.standard_normal((20, 2, 16)).astype(np.float32)
    kvq.reshape_and_cache(k, k, cache, cache.slot_mapping(a, 0, 20))
    b = cache.fork(a)
    cache.extend(b, 1)
    x = rng.standard_normal((1, 2, 16)).astype(np.float32)
    kvq.reshape_and_cache(x, x, cache, cache.slot_mapping(b, 20, 1))
    ta, tb = cache.batch_tables([a, b])["block_tables"]
    assert ta[0] == tb[0] and ta[1] != tb[1]  # full page shared, partial page copied
    assert cache.memory()["pages_used"] == 3
