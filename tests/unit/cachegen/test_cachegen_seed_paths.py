"""Seed 003's module paths `lmcache.storage_backend.serde.cachegen_*` are aliases of the package."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import ModuleType

import pytest
import torch

import lmcache.cachegen
from lmcache.compat import cachegen_seed

SEED = "lmcache.storage_backend.serde"
# seed path -> (package modules it re-exports whole, names it takes from other modules)
ALIASES: dict[str, tuple[list[str], dict[str, ModuleType | str]]] = {
    "cachegen_basics": (["config", "encoded"], {"debug_print_device": cachegen_seed}),
    "cachegen_encoder": (["encoder"], {
        "CacheGenSerializer": "serde", "torch_quant": cachegen_seed,
        "torch_quant_vectorized": cachegen_seed, "concat_max": cachegen_seed,
        "collect_bytes": cachegen_seed, "encode_function": cachegen_seed}),
    "cachegen_decoder": (["decoder"], {
        "CacheGenDeserializer": "serde", "do_dequantize": cachegen_seed, "quant": cachegen_seed,
        "decode_chunk": cachegen_seed, "decode_function_gpu": cachegen_seed}),
    **{f"cachegen_{m}": ([m], {}) for m in ("format", "quant", "layout", "rans", "kernels", "gpu", "tables")},
}
# every name seed 003 gives these modules (methods aside)
SEED_NAMES = {
    "cachegen_basics": ["CacheGenConfig", "CacheGenEncoderOutput", "CacheGenGPUBytestream",
                        "CacheGenGPUEncoderOutput", "QuantizationSpec"],
    "cachegen_decoder": ["CacheGenDeserializer", "decode_chunk", "decode_function_gpu", "do_dequantize",
                         "quant"],
    "cachegen_encoder": ["CacheGenEncoderImpl", "CacheGenSerializer", "collect_bytes", "concat_max",
                         "encode_function", "torch_quant", "torch_quant_vectorized"],
}


def _package(name: str) -> ModuleType:
    return importlib.import_module(f"lmcache.cachegen.{name}")


def _public(module: ModuleType) -> dict[str, object]:
    return {k: v for k, v in vars(module).items() if not k.startswith("_")}


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_each_seed_path_exports_the_same_objects_as_the_package(alias: str) -> None:
    module = importlib.import_module(f"{SEED}.{alias}")
    whole, extra = ALIASES[alias]
    expected: dict[str, object] = {}
    for name in whole:
        expected.update(_public(_package(name)))
    for name, source in extra.items():
        expected[name] = getattr(_package(source) if isinstance(source, str) else source, name)
    exported = _public(module)
    assert exported.keys() == expected.keys()
    assert all(exported[k] is expected[k] for k in expected)
    assert module.__doc__ is not None and module.__doc__.startswith("Seed path alias of `lmcache.cachegen.")


@pytest.mark.parametrize("alias", sorted(SEED_NAMES))
def test_the_seed_names_resolve_on_their_seed_paths(alias: str) -> None:
    module = importlib.import_module(f"{SEED}.{alias}")
    assert all(hasattr(module, name) for name in SEED_NAMES[alias])


def test_the_seed_method_debug_print_device_prints_each_tensor_field_device(capsys) -> None:
    from lmcache.storage_backend.serde.cachegen_basics import CacheGenConfig, CacheGenGPUEncoderOutput
    from lmcache.storage_backend.serde.cachegen_encoder import encode_function

    cfg = CacheGenConfig.uniform(2, 16, 16)
    kv = torch.randn(2, 2, 8, 4)
    out = encode_function(kv, cfg, torch.tensor(cfg.key_bins()), torch.tensor(cfg.value_bins()), 8)
    assert isinstance(out, CacheGenGPUEncoderOutput)
    out.debug_print_device()  # type: ignore[attr-defined]
    assert "'max_tensors_key': device(type='cpu')" in capsys.readouterr().out


def test_the_package_never_imports_the_compat_shims() -> None:
    for path in Path(lmcache.cachegen.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.startswith("lmcache.compat") for n in names), path.name
