"""Element codecs on host (numpy) arrays: kvq's formats bit for bit as the cache stores them."""
import numpy as np

from . import _kvq


def _f32(x):
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32))


def fp8_encode(x, format="fp8_e4m3", *, writer=False):
    """uint8 codes of float32 ``x`` (same shape). Round to nearest even, saturating at the format's
    max (448 OCP, 240 FNUZ); NaN -> +0, +-inf -> +-max. ``writer=True`` applies the cache writer's
    interchange rule as well (FNUZ capped at 224, OCP -0 -> +0), so the bytes mean the same in both."""
    x = _f32(x)
    out = np.empty(x.shape, dtype=np.uint8)
    _kvq.fp8_encode(x.reshape(-1), out.reshape(-1), format, writer)
    return out


def fp8_decode(codes, format="fp8_e4m3"):
    """float32 values of uint8 fp8 codes (NaN codes decode to NaN)."""
    codes = np.ascontiguousarray(np.asarray(codes, dtype=np.uint8))
    out = np.empty(codes.shape, dtype=np.float32)
    _kvq.fp8_decode(codes.reshape(-1), out.reshape(-1), format)
    return out


def quantize(x, format, scale=1.0):
    """The cache writer's row codec: bytes of encode(x / scale) for a 1-D float32 row; fp8 and
    int8: one byte per element; int4: two per byte (element 2i in the low nibble); bf16/fp16: two
    bytes per element (little endian; the scale is ignored). Non-finite inputs are written as 0."""
    x = _f32(x).reshape(-1)
    out = np.empty(_kvq.row_bytes(format, x.size), dtype=np.uint8)
    _kvq.quantize(x, out, format, float(scale))
    return out


def dequantize(codes, format, count, scale=1.0):
    """float32 [count]: decode(code) * scale of a row written by ``quantize``."""
    codes = np.ascontiguousarray(np.asarray(codes, dtype=np.uint8)).reshape(-1)
    out = np.empty(int(count), dtype=np.float32)
    _kvq.dequantize(codes, out, format, float(scale))
    return out


def encode(x, format):
    """Codes of ``x`` (same shape) at scale 1: uint8 for fp8/int8, int8 values as their two's
    complement bytes; uint16 bit patterns for bf16/fp16. int4: see ``quantize`` (packed)."""
    x = _f32(x)
    raw = quantize(x, format)
    if _kvq.row_bytes(format, 1) == 2:
        return raw.view(np.uint16).reshape(x.shape)
    if _kvq.row_bytes(format, 2) == 1:
        raise ValueError("encode: int4 codes are packed two per byte; use quantize()")
    return raw.reshape(x.shape)


def decode(codes, format):
    """Inverse of ``encode``: float32 of the same shape."""
    codes = np.ascontiguousarray(codes)
    shape = codes.shape
    out = dequantize(codes.view(np.uint8), format, codes.size, 1.0)
    return out.reshape(shape)


def transcode_fp8(codes, scales, from_format, to_format):
    """Moves an fp8 cache between OCP and FNUZ: checks every code against the interchange rule and
    rescales ``scales`` (float32 numpy array) in place (x2 to FNUZ, /2 to OCP); the codes stay.
    ValueError without changing anything when a code or a scale does not allow it exactly."""
    codes = np.ascontiguousarray(np.asarray(codes, dtype=np.uint8)).reshape(-1)
    if not (isinstance(scales, np.ndarray) and scales.dtype == np.float32 and scales.flags.c_contiguous):
        raise ValueError("transcode_fp8: scales must be a C-contiguous float32 numpy array (it is rescaled in place)")
    _kvq.transcode_fp8(codes, scales.reshape(-1), from_format, to_format)
    return scales
