"""kvq: quantized paged KV cache (FP8 OCP/FNUZ, INT8; bf16 sink) and paged attention as array ops.

Arrays are numpy arrays for a cpu cache and torch CUDA tensors for a cuda cache (any DLPack array
reaches the low-level ops in ``kvq._kvq`` with caller-made outputs). With torch installed, torch
tensors go through torch custom ops (``torch.ops.kvq.*``): CUDA graphs, torch.compile and the
current CUDA stream. Shapes, dtypes and devices are checked before any kernel runs (ValueError);
errors from kvq's C++ library keep their message (ValueError, NotImplementedError, MemoryError,
RuntimeError). docs/PYTHON.md explains the layouts and how an engine calls these.
"""
from ._cache import KVCache
from ._codecs import decode, dequantize, encode, fp8_decode, fp8_encode, quantize, transcode_fp8
from ._ops import dequantize_pages, paged_decode, paged_prefill, reshape_and_cache
from ._kvq import has_cuda

__all__ = [
    "KVCache", "reshape_and_cache", "paged_decode", "paged_prefill", "dequantize_pages",
    "fp8_encode", "fp8_decode", "encode", "decode", "quantize", "dequantize", "transcode_fp8", "has_cuda",
]
