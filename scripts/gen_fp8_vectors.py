#!/usr/bin/env python3
"""Oracle vectors for kvq's codec tests, computed with numpy + ml_dtypes.

    gen_fp8_vectors.py OUT_DIR

Writes little-endian raw arrays into OUT_DIR (name.f32 = float32, .u8 = uint8, .u16 = uint16):

  fp8_e4m3_decode.f32, fp8_e4m3_fnuz_decode.f32   all 256 codes decoded (ml_dtypes)
  int8_decode.f32 (256), int4_decode.f32 (16)      codes decoded (numpy int8, ml_dtypes int4)
  fp16_decode.f32, bf16_decode.f32                 all 65536 codes decoded
  sweep_inputs.f32                                 >= 10^6 float32 inputs for the fp8 encoders
  sweep_fp8_e4m3.u8, sweep_fp8_e4m3_fnuz.u8        ml_dtypes clamp-then-cast of each input
  half_inputs.f32, half_fp16.u16, half_bf16.u16    float32 -> fp16 (numpy) / bf16 (ml_dtypes)

ml_dtypes does not saturate (an out-of-range float becomes NaN), while kvq's encoders do, so the
fp8 expectations clamp to +-max before the cast; that is exactly the saturating semantics. NaN is
passed through unchanged (ml_dtypes gives a NaN code); the C++ test applies kvq's documented NaN
policy (NaN -> +0) to those inputs itself.

Every file is written to a temporary name and renamed, so test processes that generate into the
same folder at the same time never read a half-written file; `stamp` is written last. The inputs
come from a fixed seed.
"""
import os
import sys

try:
    import numpy as np
    import ml_dtypes
except ImportError as e:  # the C++ test shows this message
    sys.stderr.write(f"gen_fp8_vectors.py: {e}. The codec tests need the oracle: "
                     "pip install ml_dtypes numpy\n")
    sys.exit(3)

SEED = 20240611


def save(out_dir, name, arr):
    path = os.path.join(out_dir, name)
    tmp = f"{path}.tmp{os.getpid()}"
    arr_le = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False)
    with open(tmp, "wb") as f:
        f.write(arr_le.tobytes())
    os.replace(tmp, path)


def decode_table(dtype):
    return np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)


def neighbours(values):
    """values and the float32 just below / above each (in magnitude order) of both signs."""
    v = np.asarray(values, dtype=np.float32)
    v = v[np.isfinite(v)]
    up = np.nextafter(v, np.float32(np.inf))
    down = np.nextafter(v, np.float32(-np.inf))
    allv = np.concatenate([v, up, down])
    return np.concatenate([allv, -allv])


def fp8_special_inputs():
    out = []
    for dt in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz):
        vals = decode_table(dt)
        vals = np.unique(np.abs(vals[np.isfinite(vals)]).astype(np.float64))
        # every code value (all subnormals included) and the exact ties between adjacent codes
        ties = (vals[:-1] + vals[1:]) / 2
        # the tie above the largest code, as if the grid went on (448 -> 464, 240 -> 248)
        top = vals[-1]
        ties = np.append(ties, top + (top - vals[-2]) / 2)
        # the tie between 0 and the smallest subnormal, and a quarter of it
        ties = np.append(ties, [vals[1] / 2, vals[1] / 4])
        out.append(neighbours(vals.astype(np.float32)))
        out.append(neighbours(ties.astype(np.float32)))
    f32 = np.finfo(np.float32)
    specials = np.array([0.0, 224.0, 232.0, 240.0, 248.0, 256.0, 448.0, 464.0, 480.0, 512.0,
                         1e4, 1e10, 1e30, f32.max, f32.tiny, f32.smallest_subnormal,
                         2.0 ** -10, 2.0 ** -9, 2.0 ** -11, 2.0 ** -12],
                        dtype=np.float32)
    out.append(neighbours(specials))
    out.append(np.array([np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0], dtype=np.float32))
    # NaNs with payloads and both signs: kvq maps every one of them to +0
    out.append(np.array([0x7fc00001, 0x7f800001, 0xffc00000, 0xff800001, 0x7fffffff],
                        dtype=np.uint32).view(np.float32))
    return np.concatenate(out)


def fp8_sweep(rng):
    special = fp8_special_inputs()
    # random bit patterns: every sign, exponent and payload, NaN and inf included
    bits = rng.integers(0, 2 ** 32, size=600_000, dtype=np.uint64).astype(np.uint32)
    random_bits = bits.view(np.float32)
    # random values in the range where fp8 codes live (2^-14 .. 2^10), random mantissas
    exps = rng.integers(-14, 11, size=400_000)
    mant = rng.random(400_000) + 1.0
    sign = np.where(rng.random(400_000) < 0.5, -1.0, 1.0)
    in_range = (sign * mant * np.exp2(exps)).astype(np.float32)
    # a dense walk over float32 bit patterns from 2^-12 to 2^9 (stride 1024 ulps)
    lo = np.float32(2.0 ** -12).view(np.uint32)
    hi = np.float32(2.0 ** 9).view(np.uint32)
    dense = np.arange(lo, hi, 1024, dtype=np.uint32).view(np.float32)
    return np.concatenate([special, random_bits, in_range, dense, -dense])


def clamp_cast(x, dtype, vmax):
    return np.clip(x, -vmax, vmax).astype(dtype).view(np.uint8)


def half_sweep(rng):
    out = []
    f16 = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float64)
    bf16 = np.arange(65536, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    for table in (f16, bf16):
        vals = np.unique(np.abs(table[np.isfinite(table)]))
        ties = (vals[:-1] + vals[1:]) / 2  # exact in float32: one bit more than the format
        top = vals[-1]
        ties = np.append(ties, top + (top - vals[-2]) / 2)  # the overflow boundary
        out.append(neighbours(ties.astype(np.float32)))
        out.append(neighbours(vals.astype(np.float32)))
    bits = rng.integers(0, 2 ** 32, size=300_000, dtype=np.uint64).astype(np.uint32)
    out.append(bits.view(np.float32))
    out.append(np.array([np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0, 65504.0, 65519.996,
                         65520.0, 1e30, np.finfo(np.float32).max], dtype=np.float32))
    return np.concatenate(out).astype(np.float32)


def main():
    if len(sys.argv) != 2:
        sys.stderr.write("usage: gen_fp8_vectors.py OUT_DIR\n")
        return 2
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(SEED)

    save(out_dir, "fp8_e4m3_decode.f32", decode_table(ml_dtypes.float8_e4m3fn))
    save(out_dir, "fp8_e4m3_fnuz_decode.f32", decode_table(ml_dtypes.float8_e4m3fnuz))
    save(out_dir, "int8_decode.f32", np.arange(256, dtype=np.uint8).view(np.int8).astype(np.float32))
    # ml_dtypes stores int4 one per byte; the low nibble is the two's complement code
    save(out_dir, "int4_decode.f32", np.arange(16, dtype=np.uint8).view(ml_dtypes.int4).astype(np.float32))
    save(out_dir, "fp16_decode.f32", np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32))
    save(out_dir, "bf16_decode.f32",
         np.arange(65536, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32))

    x = fp8_sweep(rng)
    save(out_dir, "sweep_inputs.f32", x)
    save(out_dir, "sweep_fp8_e4m3.u8", clamp_cast(x, ml_dtypes.float8_e4m3fn, 448.0))
    save(out_dir, "sweep_fp8_e4m3_fnuz.u8", clamp_cast(x, ml_dtypes.float8_e4m3fnuz, 240.0))

    h = half_sweep(rng)
    save(out_dir, "half_inputs.f32", h)
    save(out_dir, "half_fp16.u16", h.astype(np.float16).view(np.uint16))
    save(out_dir, "half_bf16.u16", h.astype(ml_dtypes.bfloat16).view(np.uint16))
    # Written last: its presence means every file above is complete (tests reuse the folder).
    save(out_dir, "stamp", np.frombuffer(f"ml_dtypes {ml_dtypes.__version__}\n".encode(), np.uint8))
    return 0


if __name__ == "__main__":
    # overflow in nextafter(max) and NaN casts are intended here
    with np.errstate(all="ignore"):
        sys.exit(main())
