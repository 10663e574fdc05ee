"""Independent numpy references for the tests: codecs through ml_dtypes / numpy rounding, the cache
writer's scales and codes, and attention in float64. Nothing here calls kvq."""
import ml_dtypes
import numpy as np

FP8 = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e4m3_fnuz": ml_dtypes.float8_e4m3fnuz}
# The value a scale maps amax to (FNUZ: the interchange cap 224, not the format's 240).
QMAX = {"fp8_e4m3": 448.0, "fp8_e4m3_fnuz": 224.0, "int8": 127.0}
F32_MIN = np.float32(np.finfo(np.float32).tiny)


def encode_scaled(fmt, scaled):
    """Cache-writer codes (uint8) of already scaled float32 values: round to nearest even,
    saturate at the writer's max; OCP writes -0 as +0."""
    scaled = np.asarray(scaled, dtype=np.float32)
    q = np.float32(QMAX[fmt])
    clipped = np.clip(scaled, -q, q)
    if fmt == "int8":
        return np.rint(clipped).astype(np.int8).view(np.uint8)
    codes = clipped.astype(FP8[fmt]).view(np.uint8).copy()
    if fmt == "fp8_e4m3":
        codes[codes == 0x80] = 0
    return codes


def decode_codes(fmt, codes):
    codes = np.asarray(codes, dtype=np.uint8)
    if fmt == "int8":
        return codes.view(np.int8).astype(np.float64)
    if fmt in ("bf16",):
        return codes.view(ml_dtypes.bfloat16).astype(np.float64)
    if fmt in ("fp16",):
        return codes.view(np.float16).astype(np.float64)
    return codes.view(FP8[fmt]).astype(np.float64)


def scale_for(fmt, amax):
    amax = np.float32(amax)
    if not amax > 0:
        return np.float32(1.0)
    s = amax / np.float32(QMAX[fmt])
    return max(s, F32_MIN)


def bf16_bits(x):
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


class CacheModel:
    """What the planes of one layer must hold after a sequence of writes (append-only per sequence).

    fmt: fp8_e4m3 | fp8_e4m3_fnuz | int8 | bf16; gran: per_token_head | per_block_head | per_tensor.
    """

    def __init__(self, fmt, gran, num_pages, num_sink_pages, heads, block, dim):
        self.fmt, self.gran, self.bs = fmt, gran, block
        self.quantized = fmt in QMAX
        dt = np.uint8 if self.quantized else np.uint16
        self.codes = [np.zeros((num_pages, heads, block, dim), dtype=dt) for _ in range(2)]
        self.sink = [np.zeros((max(num_sink_pages, 0), heads, block, dim), dtype=np.uint16) for _ in range(2)]
        if gran == "per_token_head":
            self.scales = [np.zeros((num_pages, heads, block), dtype=np.float32) for _ in range(2)]
        elif gran == "per_block_head":
            self.scales = [np.zeros((num_pages, heads), dtype=np.float32) for _ in range(2)]
            self.amax = [np.zeros((num_pages, heads), dtype=np.float32) for _ in range(2)]
        else:
            self.scales = [np.zeros(1, dtype=np.float32) for _ in range(2)]
        self.tensor_set = False

    def write(self, slots, k, v):
        """One reshape_and_cache call: rows [n, heads, dim] to encoded slots [n]."""
        slots = np.asarray(slots)
        main = slots >= 0
        if self.quantized and self.gran == "per_tensor" and not self.tensor_set and main.any():
            for kv, x in enumerate((k, v)):
                self.scales[kv][0] = scale_for(self.fmt, np.abs(x[main]).max())
            self.tensor_set = True
        # Rows going to one page in a run of consecutive slots form one chunk (as the writer sees them).
        r = 0
        while r < len(slots):
            e = r + 1
            while (e < len(slots) and (slots[e] >= 0) == (slots[r] >= 0)
                   and self._page(slots[e]) == self._page(slots[r]) and self._slot(slots[e]) == self._slot(slots[e - 1]) + 1):
                e += 1
            for kv, x in enumerate((k, v)):
                if slots[r] < 0:
                    for t in range(r, e):
                        self.sink[kv][self._page(slots[t]), :, self._slot(slots[t])] = bf16_bits(x[t])
                else:
                    self._write_main(kv, self._page(slots[r]), self._slot(slots[r]), x[r:e])
            r = e

    def _page(self, s):
        s = int(s)
        return (-s - 1 if s < 0 else s) // self.bs

    def _slot(self, s):
        s = int(s)
        return (-s - 1 if s < 0 else s) % self.bs

    def _write_main(self, kv, page, slot0, rows):
        codes = self.codes[kv]
        n = len(rows)
        if not self.quantized:
            codes[page, :, slot0:slot0 + n] = bf16_bits(rows).transpose(1, 0, 2)
            return
        f = self.fmt
        for h in range(rows.shape[1]):
            x = rows[:, h, :].astype(np.float32)
            if self.gran == "per_token_head":
                for t in range(n):
                    s = scale_for(f, np.abs(x[t]).max())
                    self.scales[kv][page, h, slot0 + t] = s
                    codes[page, h, slot0 + t] = encode_scaled(f, x[t] / s)
            elif self.gran == "per_tensor":
                codes[page, h, slot0:slot0 + n] = encode_scaled(f, x / self.scales[kv][0])
            else:
                amax = np.float32(np.abs(x).max())
                if slot0 == 0:
                    self.amax[kv][page, h] = amax
                    self.scales[kv][page, h] = scale_for(f, amax)
                elif amax > self.amax[kv][page, h]:
                    old, grown = self.scales[kv][page, h], scale_for(f, amax)
                    for t in range(slot0):  # older tokens: decoded at the old scale, re-encoded
                        back = (decode_codes(f, codes[page, h, t]).astype(np.float32) * old).astype(np.float32)
                        codes[page, h, t] = encode_scaled(f, back / grown)
                    self.amax[kv][page, h] = amax
                    self.scales[kv][page, h] = grown
                codes[page, h, slot0:slot0 + n] = encode_scaled(f, x / self.scales[kv][page, h])


def stored_kv(cache, layer, fmt, gran, seq_len, sink_len, block_table, sink_table):
    """K and V [seq_len, heads, dim] float64 of one sequence, read from kvq's planes and decoded
    with ml_dtypes / numpy (independent of kvq's decoder)."""
    bs = cache.geometry["block_size"]
    out = []
    for kv in range(2):
        codes = (cache.key_cache if kv == 0 else cache.value_cache)(layer)
        scales = (cache.key_scales if kv == 0 else cache.value_scales)(layer)
        sink = (cache.key_sink if kv == 0 else cache.value_sink)(layer)
        rows = []
        for t in range(seq_len):
            if t < sink_len:
                rows.append(sink[sink_table[t // bs], :, t % bs].view(ml_dtypes.bfloat16).astype(np.float64))
                continue
            u = t - sink_len
            p, s = block_table[u // bs], u % bs
            if fmt in ("bf16", "fp16"):
                rows.append(decode_codes(fmt, codes[p, :, s].view(np.uint8)).reshape(codes.shape[1], -1))
                continue
            val = decode_codes(fmt, codes[p, :, s])
            if gran == "per_token_head":
                sc = scales[p, :, s].astype(np.float64)[:, None]
            elif gran == "per_block_head":
                sc = scales[p, :].astype(np.float64)[:, None]
            else:
                sc = np.float64(scales[0])
            rows.append(val * sc)
        out.append(np.stack(rows) if rows else np.zeros((0,) + codes.shape[1:2] + codes.shape[3:]))
    return out


def attention(q, k, v, scale, causal_len=None):
    """float64 softmax attention of q [num_q_heads, dim] over k, v [T, num_kv_heads, dim] (GQA:
    query head h reads kv head h // (num_q_heads / num_kv_heads)); the first causal_len keys only
    when given. Returns (out [num_q_heads, dim], lse [num_q_heads])."""
    hq, hkv = q.shape[0], k.shape[1]
    group = hq // hkv
    t = k.shape[0] if causal_len is None else causal_len
    out, lse = np.zeros(q.shape), np.zeros(hq)
    for h in range(hq):
        kh = h // group
        logits = (k[:t, kh, :] @ q[h].astype(np.float64)) * scale
        m = logits.max()
        p = np.exp(logits - m)
        out[h] = (p @ v[:t, kh, :]) / p.sum()
        lse[h] = m + np.log(p.sum())
    return out, lse


def rel_l2(got, want):
    want = np.asarray(want, dtype=np.float64)
    return float(np.linalg.norm(np.asarray(got, dtype=np.float64) - want) / max(np.linalg.norm(want), 1e-30))
