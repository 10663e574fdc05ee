"""kvq's element codecs against ml_dtypes / numpy, bit for bit."""
import ml_dtypes
import numpy as np
import pytest

import kvq
from reference import FP8, encode_scaled

ALL_CODES = np.arange(256, dtype=np.uint8)


def same_bits(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.array_equal(a.view(np.uint32), b.view(np.uint32)) or (
        np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(a[~np.isnan(a)].view(np.uint32), b[~np.isnan(b)].view(np.uint32)))


def grid_with_midpoints(ml_type):
    """Every finite value of an fp8 type, the midpoints between neighbours (ties) and random values."""
    vals = np.unique(ALL_CODES.view(ml_type).astype(np.float64))
    vals = vals[np.isfinite(vals)]
    mids = (vals[:-1] + vals[1:]) / 2
    rng = np.random.default_rng(7)
    lim = vals.max()
    rand = np.concatenate([rng.uniform(-lim, lim, 4000), rng.uniform(-1e-2, 1e-2, 2000) ])
    return np.concatenate([vals, mids, rand]).astype(np.float32)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e4m3_fnuz"])
def test_fp8_decode_every_code(fmt):
    want = ALL_CODES.view(FP8[fmt]).astype(np.float32)
    assert same_bits(kvq.fp8_decode(ALL_CODES, fmt), want)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e4m3_fnuz"])
def test_fp8_encode_in_range_matches_ml_dtypes(fmt):
    x = grid_with_midpoints(FP8[fmt])
    want = x.astype(FP8[fmt]).view(np.uint8)
    got = kvq.fp8_encode(x, fmt)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, f"{fmt}: {x[bad[:5]]} -> {got[bad[:5]]}, ml_dtypes {want[bad[:5]]}"
    # Round trip: decode(encode(x)) is ml_dtypes' rounding of x.
    assert same_bits(kvq.fp8_decode(got, fmt), x.astype(FP8[fmt]).astype(np.float32))


def test_fp8_saturation_and_non_finite():
    x = np.array([1e6, -1e6, np.inf, -np.inf, np.nan, -0.0], dtype=np.float32)
    assert list(kvq.fp8_encode(x, "fp8")) == [0x7E, 0xFE, 0x7E, 0xFE, 0x00, 0x80]
    assert list(kvq.fp8_encode(x, "fp8_fnuz")) == [0x7F, 0xFF, 0x7F, 0xFF, 0x00, 0x00]
    # The cache writer: FNUZ capped at 224 (0x7E), OCP -0 written as +0 (interchange rule).
    assert list(kvq.fp8_encode(x, "fp8_fnuz", writer=True)) == [0x7E, 0xFE, 0x7E, 0xFE, 0x00, 0x00]
    assert list(kvq.fp8_encode(x, "fp8", writer=True)) == [0x7E, 0xFE, 0x7E, 0xFE, 0x00, 0x00]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e4m3_fnuz", "int8"])
def test_writer_codes_match_reference(fmt):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(5000) * 80).astype(np.float32)
    x[:4] = [0.0, -0.0, 1000.0, -1000.0]
    got = kvq.quantize(x, fmt, 1.0)
    assert np.array_equal(got, encode_scaled(fmt, x))


def test_int8_round_trip_matches_numpy():
    rng = np.random.default_rng(4)
    x = np.concatenate([rng.uniform(-200, 200, 3000), np.arange(-130, 131) + 0.5]).astype(np.float32)
    codes = kvq.encode(x, "int8")
    want = np.clip(np.rint(x), -127, 127).astype(np.int8)
    assert np.array_equal(codes.view(np.int8), want)
    assert np.array_equal(kvq.decode(codes, "int8"), want.astype(np.float32))
    assert np.array_equal(kvq.decode(np.arange(256, dtype=np.uint8), "int8"), np.arange(256, dtype=np.uint8).view(np.int8).astype(np.float32))


def test_int4_packed_matches_numpy():
    rng = np.random.default_rng(5)
    x = rng.uniform(-9, 9, 101).astype(np.float32)
    packed = kvq.quantize(x, "int4", 1.0)
    q = np.clip(np.rint(x), -7, 7).astype(np.int8)
    lo, hi = q[0::2], np.append(q[1::2], 0)
    want = ((lo & 0xF) | ((hi & 0xF) << 4)).astype(np.uint8)
    assert np.array_equal(packed, want)
    assert np.array_equal(kvq.dequantize(packed, "int4", x.size), q.astype(np.float32))
    # ml_dtypes' int4 holds the same values.
    assert np.array_equal(q.astype(ml_dtypes.int4).astype(np.float32), kvq.dequantize(packed, "int4", x.size))


@pytest.mark.parametrize("fmt,ml", [("bf16", ml_dtypes.bfloat16), ("fp16", np.float16)])
def test_16_bit_formats(fmt, ml):
    rng = np.random.default_rng(6)
    x = np.concatenate([rng.standard_normal(4000) * 100, rng.standard_normal(100) * 1e-6]).astype(np.float32)
    bits = kvq.encode(x, fmt)
    assert bits.dtype == np.uint16
    assert np.array_equal(bits, x.astype(ml).view(np.uint16))
    assert same_bits(kvq.decode(bits, fmt), x.astype(ml).astype(np.float32))


def test_transcode_fp8_keeps_values_and_refuses_bad_codes():
    rng = np.random.default_rng(8)
    codes = kvq.fp8_encode(rng.standard_normal(512).astype(np.float32) * 50, "fp8_fnuz", writer=True)
    scales = rng.uniform(0.01, 4, 32).astype(np.float32)
    before = kvq.fp8_decode(codes, "fp8_fnuz").reshape(32, 16) * scales[:, None]
    kvq.transcode_fp8(codes, scales, "fp8_fnuz", "fp8")
    after = kvq.fp8_decode(codes, "fp8").reshape(32, 16) * scales[:, None]
    assert same_bits(before, after)
    saved = scales.copy()
    bad = codes.copy()
    bad[17] = 0x80
    with pytest.raises(ValueError, match="17"):
        kvq.transcode_fp8(bad, scales, "fp8", "fp8_fnuz")
    assert np.array_equal(scales, saved)  # nothing changed on refusal
