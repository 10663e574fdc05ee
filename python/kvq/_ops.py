"""The cache ops, with vLLM's argument names and layouts where an equivalent exists.

numpy arrays run on a cpu cache right here; torch tensors go through the torch custom ops of
kvq/torch_ops.py (current CUDA stream, CUDA graphs, torch.compile).
"""
import numpy as np

from . import _kvq

OWN_STREAM = -1  # the backend's own stream (then synchronised before returning)


def _is_torch(x):
    return type(x).__module__.startswith("torch")


def _torch_ops():
    from . import torch_ops  # registers torch.ops.kvq.* on first use
    return torch_ops


def _no_sink(n):
    return np.zeros(n, dtype=np.int32)


def _host(*xs):
    """Lists and scalars become numpy arrays with their own dtype (a wrong one is then refused with
    a ValueError by the op, never converted silently)."""
    return [x if x is None or hasattr(x, "__dlpack__") else np.asarray(x) for x in xs]


def reshape_and_cache(key, value, cache, slot_mapping, layer=0):
    """Quantize-on-write of new K/V rows: key/value [num_tokens, num_kv_heads, head_dim] float32,
    slot_mapping [num_tokens] int32 (KVCache.slot_mapping). Scales are set as the cache's spec says
    (per_block_head pages grow and re-quantize their older tokens)."""
    if _is_torch(key):
        return _torch_ops().reshape_and_cache(key, value, cache, slot_mapping, layer)
    key, value, slot_mapping = _host(key, value, slot_mapping)
    _kvq.reshape_and_cache(cache._c, key, value, slot_mapping, int(layer), OWN_STREAM)


def paged_decode(query, cache, block_tables, seq_lens, layer=0, *, sink_tables=None, sink_lens=None,
                 softmax_scale=None, out=None, lse=None):
    """One query token per sequence over the cache as stored. query [num_seqs, num_q_heads,
    head_dim] float32 (GQA: num_q_heads a multiple of num_kv_heads); block_tables [num_seqs,
    max_blocks] int32; seq_lens [num_seqs] int32 (tokens in the cache, sink included); sink_tables /
    sink_lens as KVCache.batch_tables gives them (None: no sink). Returns (out [num_seqs,
    num_q_heads, head_dim], lse [num_seqs, num_q_heads], natural log of the scaled logits' sum)."""
    if _is_torch(query):
        return _torch_ops().paged_decode(query, cache, block_tables, seq_lens, layer, sink_tables=sink_tables,
                                         sink_lens=sink_lens, softmax_scale=softmax_scale, out=out, lse=lse)
    query, block_tables, seq_lens, sink_tables, sink_lens = _host(query, block_tables, seq_lens, sink_tables, sink_lens)
    n = query.shape[0] if query.ndim == 3 else 0
    if out is None:
        out = np.empty(query.shape, dtype=np.float32)
    if lse is None:
        lse = np.empty(query.shape[:2], dtype=np.float32)
    _kvq.paged_decode(cache._c, query, block_tables, seq_lens, sink_tables,
                      _no_sink(n) if sink_lens is None else sink_lens, out, lse, int(layer),
                      float(softmax_scale or 0.0), OWN_STREAM)
    return out, lse


def paged_prefill(query, cache, block_tables, seq_lens, q_pos0, layer=0, *, sink_tables=None, sink_lens=None,
                  softmax_scale=None, out=None, lse=None):
    """Causal attention of one sequence's query tokens at positions [q_pos0, q_pos0 + num_tokens)
    over its cached prefix and themselves (their K/V written first with reshape_and_cache).
    query [num_tokens, num_q_heads, head_dim]; tables as paged_decode with num_seqs = 1."""
    if _is_torch(query):
        return _torch_ops().paged_prefill(query, cache, block_tables, seq_lens, q_pos0, layer,
                                          sink_tables=sink_tables, sink_lens=sink_lens,
                                          softmax_scale=softmax_scale, out=out, lse=lse)
    query, block_tables, seq_lens, sink_tables, sink_lens = _host(query, block_tables, seq_lens, sink_tables, sink_lens)
    if out is None:
        out = np.empty(query.shape, dtype=np.float32)
    if lse is None:
        lse = np.empty(query.shape[:2], dtype=np.float32)
    _kvq.paged_prefill(cache._c, query, block_tables, seq_lens, sink_tables,
                       _no_sink(1) if sink_lens is None else sink_lens, int(q_pos0), out, lse, int(layer),
                       float(softmax_scale or 0.0), OWN_STREAM)
    return out, lse


def dequantize_pages(cache, pages, layer=0, *, sink=False):
    """(K, V) float32 numpy [len(pages), num_kv_heads, block_size, head_dim]: decode(code) * scale of
    whole pages as stored (sink=True: bf16 sink pages). Reads a cuda cache back to the host."""
    pages = np.ascontiguousarray(np.asarray(pages, dtype=np.int32)).reshape(-1)
    g = cache.geometry
    shape = (pages.size, g["num_kv_heads"], g["block_size"], g["head_dim"])
    k, v = np.empty(shape, dtype=np.float32), np.empty(shape, dtype=np.float32)
    _kvq.dequantize_pages(cache._c, int(layer), pages, bool(sink), k, v)
    return k, v
