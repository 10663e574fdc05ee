"""KVCache: the pools of one quantized paged KV cache (see docs/PYTHON.md for the layouts)."""
import itertools
import weakref

import numpy as np

from . import _kvq

# Integer handles for the torch custom ops, whose arguments must be tensors or scalars.
_registry = weakref.WeakValueDictionary()
_ids = itertools.count(1)


def _lookup(cache_id):
    cache = _registry.get(cache_id)
    if cache is None:
        raise ValueError(f"kvq: no live KVCache with id {cache_id}")
    return cache


class KVCache:
    """Quantized pages, bf16 sink pages and scale planes of ``num_layers`` layers.

    kv_cache_dtype: vLLM's names: fp8 (= fp8_e4m3, OCP), fp8_fnuz (fp8_e4m3_fnuz), int8, bf16, fp16, auto.
    granularity: per_token_head (default) | per_block_head | per_tensor.
    block_size: 16 | 32 tokens per page.  sink_tokens: first N tokens of each sequence kept in bf16
    (0: no sink, as in vLLM). num_sink_pages defaults to enough sink pages for ``max_seqs`` sequences.
    device: "cpu" or "cuda[:N]" (the planes then live in GPU memory).
    """

    def __init__(self, kv_cache_dtype="fp8", *, num_pages, num_kv_heads, head_dim, num_layers=1,
                 block_size=16, granularity="per_token_head", sink_tokens=0, num_sink_pages=None,
                 max_seqs=16, device="cpu"):
        o = _kvq.CacheOptions()
        o.kv_cache_dtype, o.granularity, o.device = str(kv_cache_dtype), str(granularity), str(device)
        o.num_layers, o.num_kv_heads, o.head_dim = int(num_layers), int(num_kv_heads), int(head_dim)
        o.num_pages, o.block_size, o.sink_tokens = int(num_pages), int(block_size), int(sink_tokens)
        if num_sink_pages is None:
            per_seq = -(-int(sink_tokens) // int(block_size)) if int(block_size) > 0 else 0
            num_sink_pages = per_seq * int(max_seqs)
        o.num_sink_pages = int(num_sink_pages)
        self._c = _kvq.Cache(o)
        self.id = next(_ids)
        _registry[self.id] = self
        self._planes = {}

    # ---- what it is ------------------------------------------------------------------------
    @property
    def geometry(self):
        """num_layers, num_kv_heads, head_dim, block_size, num_pages, num_sink_pages, format, granularity, ..."""
        return self._c.geometry

    @property
    def spec(self):
        return self._c.spec

    @property
    def device(self):
        return self._c.device

    @property
    def is_cuda(self):
        return self._c.device.startswith("cuda")

    @property
    def bytes_per_token(self):
        """KV bytes per token over all layers, K and V, scales included (sink tokens are bf16)."""
        return self._c.bytes_per_token

    @property
    def bytes_per_page(self):
        """Exact bytes of one page index over all layers, K and V, scales included: the unit of
        sizing a cache from a memory budget (num_pages = budget // bytes_per_page)."""
        return self._c.bytes_per_page_all_layers

    def memory(self):
        return self._c.memory()

    def stats(self):
        return self._c.stats()

    def __repr__(self):
        return f"KVCache({self.spec}, {self.geometry}, device={self.device})"

    # ---- sequences (kvq's block allocator decides where tokens go) -----------------------------
    def add_sequence(self, sink_tokens=-1):
        return self._c.add_sequence(sink_tokens)

    def fork(self, parent):
        return self._c.fork(parent)

    def free(self, seq):
        self._c.free(seq)

    def extend(self, seq, num_tokens):
        """Reserves ``num_tokens`` more slots for ``seq`` (pages allocated; MemoryError when full)."""
        self._c.extend(seq, num_tokens)

    def seq_len(self, seq):
        return self._c.seq_len(seq)

    def sequences(self):
        return self._c.sequences()

    def slot_mapping(self, seq, pos0, num_tokens):
        """int32 [num_tokens]: where tokens [pos0, pos0 + n) of ``seq`` are written (vLLM's slot_mapping;
        a sink slot is -(sink_page * block_size + slot) - 1)."""
        return np.asarray(self._c.token_slots(seq, pos0, num_tokens), dtype=np.int32)

    def batch_tables(self, seqs):
        """Padded tables of a batch, as numpy int32: seq_lens [n], sink_lens [n], block_tables
        [n, max_blocks], sink_tables [n, max_sink_blocks] (unused entries -1)."""
        t = self._c.batch_tables([int(s) for s in seqs])
        n = len(seqs)
        return {
            "seq_lens": np.asarray(t["seq_lens"], dtype=np.int32),
            "sink_lens": np.asarray(t["sink_lens"], dtype=np.int32),
            "block_tables": np.asarray(t["block_tables"], dtype=np.int32).reshape(n, t["max_blocks"]),
            "sink_tables": np.asarray(t["sink_tables"], dtype=np.int32).reshape(n, t["max_sink_blocks"]),
        }

    # ---- the planes, as views of the cache's own memory ---------------------------------------
    def _plane(self, kind, layer, kv):
        key = (kind, layer, kv)
        if key not in self._planes:
            raw = getattr(self._c, kind)(layer, kv)
            if raw is None:
                view = None
            elif self.is_cuda:
                import torch.utils.dlpack
                view = torch.utils.dlpack.from_dlpack(raw)
            else:
                view = raw
            self._planes[key] = view
        return self._planes[key]

    def key_cache(self, layer=0):
        """Codes [num_pages, num_kv_heads, block_size, head_dim]: uint8 (fp8/int8), uint16 (bf16/fp16 bits)."""
        return self._plane("codes", layer, 0)

    def value_cache(self, layer=0):
        return self._plane("codes", layer, 1)

    def key_scales(self, layer=0):
        """fp32 scales: [num_pages, heads, block] (per_token_head), [num_pages, heads] (per_block_head),
        [1] (per_tensor); None for bf16/fp16."""
        return self._plane("scales", layer, 0)

    def value_scales(self, layer=0):
        return self._plane("scales", layer, 1)

    def key_sink(self, layer=0):
        """bf16 bits (uint16) [num_sink_pages, heads, block, head_dim]; None without sink pages."""
        return self._plane("sink", layer, 0)

    def value_sink(self, layer=0):
        return self._plane("sink", layer, 1)
