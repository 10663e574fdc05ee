"""kvq's ops as PyTorch custom ops (torch.ops.kvq.*), imported on first use of a torch tensor.

Why custom ops: torch.compile and CUDA graphs need to know what an op reads and writes, and
outputs must come from torch's allocator. So each op takes the cache's planes as tensors (views of
the cache's own memory, declared mutated by reshape_and_cache and read by the attention ops), the
cache itself as an integer handle, and caller-made outputs; the work is enqueued on torch's current
CUDA stream, so it orders with the surrounding torch work and is captured by torch.cuda.graph
(warm up eagerly first: the first run of a shape plans and may grow a workspace).
"""
from typing import Optional

import numpy as np
import torch

from . import _kvq
from ._cache import _lookup

OWN_STREAM = -1


def _stream(t):
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else OWN_STREAM


def _planes(cache, layer):
    """The six plane tensors of one layer (an empty tensor where the cache has no such plane)."""
    key = ("torch", layer)
    if key not in cache._planes:
        dev = torch.device(cache.device)
        out = []
        for get in (cache.key_cache, cache.value_cache, cache.key_scales, cache.value_scales,
                    cache.key_sink, cache.value_sink):
            p = get(layer)
            if p is None:
                out.append(torch.empty(0, dtype=torch.uint8, device=dev))
            elif isinstance(p, np.ndarray):
                out.append(torch.from_numpy(p))
            else:
                out.append(p)
        cache._planes[key] = tuple(out)
    return cache._planes[key]


_PLANES = ("k_codes", "v_codes", "k_scales", "v_scales", "k_sink", "v_sink")


def _writes_only(*args, **kwargs):
    """Fake (meta) implementation for torch.compile: the ops return nothing, they only write into
    arguments they declare mutated."""
    return None


@torch.library.custom_op("kvq::reshape_and_cache", mutates_args=_PLANES)
def _reshape_and_cache(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, k_codes: torch.Tensor,
                       v_codes: torch.Tensor, k_scales: torch.Tensor, v_scales: torch.Tensor, k_sink: torch.Tensor,
                       v_sink: torch.Tensor, cache_id: int, layer: int) -> None:
    _kvq.reshape_and_cache(_lookup(cache_id)._c, key.detach(), value.detach(), slot_mapping.detach(), layer, _stream(key))


_reshape_and_cache.register_fake(_writes_only)


@torch.library.custom_op("kvq::paged_decode", mutates_args=("out", "lse"))
def _paged_decode(query: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  sink_tables: Optional[torch.Tensor], sink_lens: torch.Tensor, k_codes: torch.Tensor,
                  v_codes: torch.Tensor, k_scales: torch.Tensor, v_scales: torch.Tensor, k_sink: torch.Tensor,
                  v_sink: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, cache_id: int, layer: int,
                  softmax_scale: float) -> None:
    _kvq.paged_decode(_lookup(cache_id)._c, query.detach(), block_tables, seq_lens, sink_tables, sink_lens, out, lse,
                      layer, softmax_scale, _stream(query))


_paged_decode.register_fake(_writes_only)


@torch.library.custom_op("kvq::paged_prefill", mutates_args=("out", "lse"))
def _paged_prefill(query: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   sink_tables: Optional[torch.Tensor], sink_lens: torch.Tensor, k_codes: torch.Tensor,
                   v_codes: torch.Tensor, k_scales: torch.Tensor, v_scales: torch.Tensor, k_sink: torch.Tensor,
                   v_sink: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, cache_id: int, layer: int,
                   q_pos0: int, softmax_scale: float) -> None:
    _kvq.paged_prefill(_lookup(cache_id)._c, query.detach(), block_tables, seq_lens, sink_tables, sink_lens, q_pos0,
                       out, lse, layer, softmax_scale, _stream(query))


_paged_prefill.register_fake(_writes_only)


def reshape_and_cache(key, value, cache, slot_mapping, layer=0):
    torch.ops.kvq.reshape_and_cache(key, value, slot_mapping, *_planes(cache, layer), cache.id, int(layer))


def _outputs(query, out, lse):
    if out is None:
        out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    if lse is None:
        lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
    return out, lse


def _sink_lens(sink_lens, n, like):
    return torch.zeros(n, dtype=torch.int32, device=like.device) if sink_lens is None else sink_lens


def paged_decode(query, cache, block_tables, seq_lens, layer=0, *, sink_tables=None, sink_lens=None,
                 softmax_scale=None, out=None, lse=None):
    out, lse = _outputs(query, out, lse)
    torch.ops.kvq.paged_decode(query, block_tables, seq_lens, sink_tables,
                               _sink_lens(sink_lens, query.shape[0] if query.dim() == 3 else 0, query),
                               *_planes(cache, layer), out, lse, cache.id, int(layer), float(softmax_scale or 0.0))
    return out, lse


def paged_prefill(query, cache, block_tables, seq_lens, q_pos0, layer=0, *, sink_tables=None, sink_lens=None,
                  softmax_scale=None, out=None, lse=None):
    out, lse = _outputs(query, out, lse)
    torch.ops.kvq.paged_prefill(query, block_tables, seq_lens, sink_tables, _sink_lens(sink_lens, 1, query),
                                *_planes(cache, layer), out, lse, cache.id, int(layer), int(q_pos0),
                                float(softmax_scale or 0.0))
    return out, lse
