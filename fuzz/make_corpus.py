#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpus: tiny valid (and a few nearly valid) inputs per target,
built byte by byte from the format descriptions (no model files). Rerun after changing it:

    python3 fuzz/make_corpus.py        (writes fuzz/corpus/<target>/*)
"""
import os
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def save(target, name, data):
    d = os.path.join(ROOT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# ---- GGUF -----------------------------------------------------------------------------------
def gstr(s):
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


SCALAR = {"u8": (0, "<B"), "i8": (1, "<b"), "u16": (2, "<H"), "i16": (3, "<h"), "u32": (4, "<I"), "i32": (5, "<i"),
          "f32": (6, "<f"), "bool": (7, "<B"), "u64": (10, "<Q"), "i64": (11, "<q"), "f64": (12, "<d")}


def kv(key, kind, value):
    if kind == "str":
        return gstr(key) + struct.pack("<I", 8) + gstr(value)
    if kind == "strs":
        return gstr(key) + struct.pack("<IIQ", 9, 8, len(value)) + b"".join(gstr(v) for v in value)
    if kind.endswith("[]"):
        t, fmt = SCALAR[kind[:-2]]
        return gstr(key) + struct.pack("<IIQ", 9, t, len(value)) + b"".join(struct.pack(fmt, v) for v in value)
    t, fmt = SCALAR[kind]
    return gstr(key) + struct.pack("<I", t) + struct.pack(fmt, value)


def gguf(meta, tensors, version=3, alignment=32):
    """meta: list of kv() entries; tensors: (name, dims, type, bytes)."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(meta)) + b"".join(meta)
    data, table = b"", b""
    for name, dims, ttype, raw in tensors:
        data += b"\0" * (-len(data) % alignment)
        table += gstr(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        table += struct.pack("<IQ", ttype, len(data))
        data += raw
    out += table
    out += b"\0" * (-len(out) % alignment)
    return out + data


def f32s(vals):
    return b"".join(struct.pack("<f", v) for v in vals)


def f16s(vals):
    return b"".join(struct.pack("<e", v) for v in vals)


def q8_0(vals):  # blocks of 32: fp16 scale, 32 int8
    out = b""
    for b in range(0, len(vals), 32):
        blk = vals[b:b + 32]
        d = max(abs(v) for v in blk) / 127 or 1.0
        out += struct.pack("<e", d) + bytes((round(v / d) & 0xFF) for v in blk)
    return out


def byte_symbols():
    """GPT-2's byte-level alphabet: printable bytes as themselves, the rest shifted past 255."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    syms, n = [], 0
    for b in range(256):
        if b in keep:
            syms.append(chr(b))
        else:
            syms.append(chr(256 + n))
            n += 1
    return syms


def gguf_tokenizer_meta(pre="smollm"):
    toks = byte_symbols() + ["Ġt", "he", "Ġthe", "<|im_start|>", "<|im_end|>", "12"]
    types = [1] * (len(toks) - 3) + [3, 3, 1]
    return [
        kv("tokenizer.ggml.model", "str", "gpt2"),
        kv("tokenizer.ggml.pre", "str", pre),
        kv("tokenizer.ggml.tokens", "strs", toks),
        kv("tokenizer.ggml.token_type", "i32[]", types),
        kv("tokenizer.ggml.merges", "strs", ["Ġ t", "h e", "Ġt he"]),
        kv("tokenizer.ggml.bos_token_id", "u32", len(toks) - 3),
        kv("tokenizer.ggml.eos_token_id", "u32", len(toks) - 2),
        kv("tokenizer.ggml.add_bos_token", "bool", 0),
    ]


def tiny_llama_gguf(vocab, dim=8, hid=16, layers=1, heads=2, kv_heads=1, ttype="f32"):
    hd = dim // heads
    meta = [kv("general.architecture", "str", "llama"), kv("general.name", "str", "tiny"),
            kv("llama.embedding_length", "u32", dim), kv("llama.block_count", "u32", layers),
            kv("llama.attention.head_count", "u32", heads), kv("llama.attention.head_count_kv", "u32", kv_heads),
            kv("llama.feed_forward_length", "u32", hid), kv("llama.context_length", "u32", 16),
            kv("llama.rope.freq_base", "f32", 10000.0), kv("llama.attention.layer_norm_rms_epsilon", "f32", 1e-5)]
    meta += gguf_tokenizer_meta()
    enc = {"f32": (0, f32s), "f16": (1, f16s)}[ttype]

    def t(name, dims):
        n = 1
        for d in dims:
            n *= d
        return (name, dims, enc[0], enc[1]([((i * 37) % 11 - 5) / 8 for i in range(n)]))
    ts = [t("token_embd.weight", [dim, vocab]), t("output_norm.weight", [dim])]
    for l in range(layers):
        p = f"blk.{l}."
        ts += [t(p + "attn_norm.weight", [dim]), t(p + "attn_q.weight", [dim, heads * hd]),
               t(p + "attn_k.weight", [dim, kv_heads * hd]), t(p + "attn_v.weight", [dim, kv_heads * hd]),
               t(p + "attn_output.weight", [heads * hd, dim]), t(p + "ffn_norm.weight", [dim]),
               t(p + "ffn_gate.weight", [dim, hid]), t(p + "ffn_up.weight", [dim, hid]),
               t(p + "ffn_down.weight", [hid, dim])]
    return gguf(meta, ts)


# ---- llama2.c -------------------------------------------------------------------------------
def llama2c_checkpoint(dim=8, hid=16, layers=1, heads=2, kv_heads=1, vocab=16, seq=4, tied=True):
    hd = dim // heads
    floats = vocab * dim + layers * (2 * dim + 2 * heads * hd * dim + 2 * kv_heads * hd * dim + 3 * hid * dim) + dim + seq * hd
    if not tied:
        floats += vocab * dim
    head = struct.pack("<7i", dim, hid, layers, heads, kv_heads, vocab if tied else -vocab, seq)
    return head + f32s([((i * 13) % 7 - 3) / 16 for i in range(floats)])


def llama2c_tokenizer(pieces, scores=None):
    scores = scores or [float(-i) for i in range(len(pieces))]
    out = struct.pack("<i", max(len(p.encode()) for p in pieces))
    for p, s in zip(pieces, scores):
        b = p.encode()
        out += struct.pack("<fi", s, len(b)) + b
    return out


def main():
    # gguf: every value type, three tensor encodings, both versions; one truncated file.
    meta = [kv("general.architecture", "str", "llama"), kv("general.alignment", "u32", 32),
            kv("t.u8", "u8", 200), kv("t.i16", "i16", -3), kv("t.u64", "u64", 1 << 40), kv("t.f64", "f64", -1.5),
            kv("t.bool", "bool", 1), kv("t.strs", "strs", ["a", "", "ccc"]), kv("t.ints", "i32[]", [3, -4, 5])]
    tens = [("a.weight", [3, 2], 0, f32s([1, 2, 3, 4, 5, 6])), ("b.weight", [4], 1, f16s([0.5, -1, 2, 0])),
            ("c.weight", [32], 8, q8_0([i / 7 for i in range(32)]))]
    full = gguf(meta, tens)
    save("gguf", "types_v3.gguf", full)
    save("gguf", "types_v2.gguf", gguf(meta, tens, version=2))
    save("gguf", "truncated.gguf", full[: len(full) - 9])
    save("gguf", "empty_tables.gguf", gguf([], []))

    save("gguf_tokenizer", "smollm.gguf", gguf(gguf_tokenizer_meta("smollm"), []))
    save("gguf_tokenizer", "gpt2.gguf", gguf(gguf_tokenizer_meta("gpt2"), []))

    save("llama2c_model", "tied.bin", llama2c_checkpoint())
    save("llama2c_model", "untied.bin", llama2c_checkpoint(tied=False))
    save("llama2c_model", "tiny_llama.gguf", tiny_llama_gguf(len(byte_symbols()) + 6))

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [" ", "a", "b", " a", "ab", " ab", "é"]
    tok = llama2c_tokenizer(pieces)
    save("llama2c_tokenizer", "bytes_and_merges.bin", struct.pack("<H", len(pieces)) + tok)
    small = ["<unk>", "<s>", "</s>", " ", "h", "i", " h", "hi", "<0x-1>"]
    save("llama2c_tokenizer", "small.bin", struct.pack("<H", len(small)) + llama2c_tokenizer(small))

    save("text", "ascii.txt", b"\x00" + b"The quick brown fox.\nJumps over the lazy dog.\n")
    save("text", "utf8_cut.txt", b"\x05" + "xééé日本".encode())
    save("text", "invalid.txt", b"\x10" + b"\xc3\x28 \xff\xfe \xe2\x82 ok")

    ints = struct.pack("<ii", 16, 256)
    save("cache_spec", "fp8.txt", b"fp8\nper_token_head\nfp32\nbf16,fp8,int8:per_block_head:sink0:b32" + ints)
    save("cache_spec", "auto.txt", b"auto\nper_tensor\nfp32\nauto,fp8_fnuz:per_tensor" + struct.pack("<ii", 32, 0))
    save("cache_spec", "bad.txt", b"int4\nper_row\nfp16\nfp8:sink-1:b7,," + struct.pack("<ii", 0, -1))

    # serve_request: first byte = chat (bit 0), llama2.c tokenizer (bit 1), context (bits 2-7).
    def req(name, flags, body):
        save("serve_request", name, bytes([flags]) + body.encode())
    req("completion.json", 0xFC, '{"model":"m","prompt":"the 12 the","max_tokens":7,"temperature":0.5,"top_p":0.9,'
        '"seed":-1,"stream":true,"stream_options":{"include_usage":true},"stop":["he","\\n"],"ignore_eos":true}')
    req("ids.json", 0x7E, '{"prompt":[1,2,300,-1],"n":1,"best_of":1,"logprobs":false,"stop":"a"}')
    req("chat.json", 0xFD, '{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":'
        '[{"type":"text","text":"the "},{"type":"text","text":"caf\\u00e9 <|im_end|>"}]},'
        '{"role":"assistant","content":"12"},{"role":"developer","content":""}],"max_completion_tokens":3}')
    req("chat_llama2c.json", 0xFF, '{"messages":[{"role":"user","content":"ab a \\u00ff"}],"stop":["b",""]}')
    req("bad.json", 0x01, '{"messages":[{"role":"robot","content":1}],"temperature":"hot","n":2}')


if __name__ == "__main__":
    main()
