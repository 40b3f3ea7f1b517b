"""Which model produced a KV cache: a name plus a fingerprint of the checkpoint's weights.

Two checkpoints with the same name (a re-quantized or fine-tuned copy) must not share KV, so cache
keys carry `checkpoint_fingerprint`: xxh3-64 over ``config.json`` and, for every weights file, its
name, size and first and last MiB (cheap even for large models, and any re-export changes it).
Both integrations (vLLM and HF transformers) use these functions, so they share keys.
"""

from __future__ import annotations

import os
from pathlib import Path

import xxhash

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_EDGE = 1 << 20


def model_name(model: str) -> str:
    """The folder name of a local checkpoint, or the hub id as given."""
    path = Path(model)
    return path.resolve().name if path.is_dir() else model


def checkpoint_fingerprint(model: str) -> str:
    """Fingerprint of a local checkpoint folder; '' for a name that is not a local folder."""
    path = Path(model)
    if not path.is_dir():
        return ""
    h = xxhash.xxh3_64()
    config = path / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for f in sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_EDGE))
            fh.seek(max(0, size - _EDGE), os.SEEK_SET)
            h.update(fh.read(_EDGE))
    return h.hexdigest()
