"""Bad arguments are refused before any kernel runs, with a message that says what to change;
errors from the C++ library keep their message."""
import numpy as np
import pytest

import kvq


@pytest.fixture
def cache():
    c = kvq.KVCache("fp8", num_pages=4, num_kv_heads=2, head_dim=16)
    s = c.add_sequence()
    c.extend(s, 5)
    c.seq = s
    return c


def rows(n, heads=2, dim=16, dtype=np.float32):
    return np.ones((n, heads, dim), dtype=dtype)


def decode_args(c, **over):
    t = c.batch_tables([c.seq])
    args = dict(query=np.ones((1, 4, 16), np.float32), cache=c, block_tables=t["block_tables"], seq_lens=t["seq_lens"])
    args.update(over)
    return args


@pytest.mark.parametrize("key,match", [
    (rows(5, dtype=np.float64), "key must be float32, got float64"),
    (rows(5, heads=3), r"key must have shape \[num_tokens, num_kv_heads, head_dim\]"),
    (rows(5, dim=8), r"got \[5, 2, 8\]"),
    (np.ones((5, 32), np.float32), "key must have shape"),
    (np.ones((5, 2, 32), np.float32)[:, :, ::2], "C-contiguous"),
])
def test_write_refuses_bad_key(cache, key, match):
    with pytest.raises(ValueError, match=match):
        kvq.reshape_and_cache(key, rows(5), cache, cache.slot_mapping(cache.seq, 0, 5))


def test_write_refuses_bad_slots(cache):
    with pytest.raises(ValueError, match="slot_mapping must be int32, got int64"):
        kvq.reshape_and_cache(rows(5), rows(5), cache, cache.slot_mapping(cache.seq, 0, 5).astype(np.int64))
    with pytest.raises(ValueError, match=r"slot_mapping must have shape \[num_tokens\]"):
        kvq.reshape_and_cache(rows(5), rows(5), cache, cache.slot_mapping(cache.seq, 0, 4))
    with pytest.raises(ValueError, match="in no page of a live sequence"):
        kvq.reshape_and_cache(rows(1), rows(1), cache, np.array([3 * 16], np.int32))
    with pytest.raises(ValueError, match="layer 3 is outside"):
        kvq.reshape_and_cache(rows(5), rows(5), cache, cache.slot_mapping(cache.seq, 0, 5), layer=3)
    with pytest.raises(ValueError, match="not reserved"):
        cache.slot_mapping(cache.seq, 3, 4)


def test_write_keeps_the_library_message(cache):
    # Token 3 before tokens 0..2 of this layer: the host cache refuses out-of-order writes.
    with pytest.raises(ValueError, match="written"):
        kvq.reshape_and_cache(rows(1), rows(1), cache, cache.slot_mapping(cache.seq, 3, 1))


@pytest.mark.parametrize("over,match", [
    (dict(query=np.ones((1, 4, 16), np.float16)), "query must be float32, got float16"),
    (dict(query=np.ones((1, 3, 16), np.float32)), "num_q_heads 3 is not a multiple of the cache's 2 kv heads"),
    (dict(query=np.ones((1, 4, 32), np.float32)), r"query must have shape \[num_seqs, num_q_heads, head_dim\]"),
    (dict(seq_lens=np.array([5, 5], np.int32)), r"seq_lens must have shape \[num_seqs\]"),
    (dict(block_tables=np.zeros((1, 1), np.int64)), "block_tables must be int32, got int64"),
    (dict(block_tables=np.array([[9]], np.int32)), "9"),  # page out of range: the library's check
    (dict(seq_lens=np.array([40], np.int32)), "40"),      # longer than its table covers
    (dict(out=np.ones((1, 4, 8), np.float32)), r"out must have shape"),
])
def test_decode_refuses_bad_arguments(cache, over, match):
    with pytest.raises(ValueError, match=match):
        kvq.paged_decode(**decode_args(cache, **over))


def test_prefill_checks(cache):
    t = cache.batch_tables([cache.seq])
    with pytest.raises(ValueError, match="q_pos0 must be >= 0"):
        kvq.paged_prefill(np.ones((2, 2, 16), np.float32), cache, t["block_tables"], t["seq_lens"], -1)
    with pytest.raises(ValueError, match=r"seq_lens must have shape \[num_seqs\] = \[1\]"):
        kvq.paged_prefill(np.ones((2, 2, 16), np.float32), cache, t["block_tables"], np.array([5, 5], np.int32), 0)


def test_cache_construction_errors():
    with pytest.raises(ValueError, match="fp9.*accepted: auto"):
        kvq.KVCache("fp9", num_pages=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(NotImplementedError, match="int4_kivi"):
        kvq.KVCache("int4_kivi", num_pages=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="head_dim"):
        kvq.KVCache("fp8", num_pages=4, num_kv_heads=2, head_dim=12)
    with pytest.raises(ValueError, match="block"):
        kvq.KVCache("fp8", num_pages=4, num_kv_heads=2, head_dim=16, block_size=8)
    with pytest.raises(ValueError, match="device"):
        kvq.KVCache("fp8", num_pages=4, num_kv_heads=2, head_dim=16, device="tpu")
    if not kvq.has_cuda:
        with pytest.raises(NotImplementedError, match="cuda"):
            kvq.KVCache("fp8", num_pages=4, num_kv_heads=2, head_dim=16, device="cuda")


def test_pool_exhaustion_is_memory_error(cache):
    with pytest.raises(MemoryError, match="pages"):
        cache.extend(cache.seq, 1000)


def test_codec_errors():
    with pytest.raises(ValueError, match="fp8_encode: format must be fp8_e4m3 or fp8_e4m3_fnuz"):
        kvq.fp8_encode([1.0], "int8")
    with pytest.raises(ValueError, match="transcode_fp8"):
        kvq.transcode_fp8(np.zeros(4, np.uint8), [1.0], "fp8", "fp8_fnuz")
