"""CacheGen's GPU coder (`lmcache.cachegen.gpu`: torch quantizer + nvCOMP ANS) on its own, for a
CUDA machine that has neither the local model nor network: GB/s of bf16 KV through `to_bytes` of
a CUDA chunk and through the decode of its stream to a CUDA tensor (`cachegen_coder_speed.
measure_gpu`, medians of --repeats), bits/value, and the round trip's error.

KV, 256-token chunks: real SmolLM2-135M KV (30 layers x 192 channels, 5.9 MB) read from `--kv`,
and the 8B-like chunk (32 layers x 1,024 channels, 33.5 MB) tiled from it exactly as
`cachegen_common.kv_8b_like` tiles (so it equals the first 256 tokens of that benchmark's KV).
`--save-kv FILE` writes that file here, from kv_8b_like's cache (its first 30 layers x 192
channels are SmolLM2's). Without the file, synthetic KV with real KV's traits (per-channel
offsets with outliers, token norms over a decade, Laplace noise, smooth channels) stands in, and
the JSON says so.

    PYTHONPATH=. python benchmarks/cachegen_gpu_coder.py [--kv FILE] [--repeats 10] [--out DIR]

Without CUDA or nvCOMP it says which is missing, writes that in the JSON and exits 0.
Goal (issue 36): >= 20 GB/s encode and decode.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from cachegen_coder_speed import CHUNK, measure_gpu, serde_pair

SMOL = (30, 3, 64)  # layers, KV heads, head size
BIG = (32, 8, 128)
GOAL_GBPS = 20.0
OUT = Path(__file__).with_name("out")


def tile_8b_like(smol: torch.Tensor, layers: int = 32, hidden: int = 1024) -> torch.Tensor:
    """SmolLM2 KV [2, 30, T, 192] -> [2, layers, T, hidden]: layer l, channels [192 j, 192 (j+1))
    hold SmolLM2 layer (l + 7 j) % 30 (as `cachegen_common.kv_8b_like`)."""
    nreal, width = smol.shape[1], smol.shape[3]
    out = torch.empty(2, layers, smol.shape[2], hidden, dtype=smol.dtype)
    for layer in range(layers):
        for j in range(-(-hidden // width)):
            end = min(hidden, (j + 1) * width)
            out[:, layer, :, j * width:end] = smol[:, (layer + 7 * j) % nreal][..., : end - j * width]
    return out


def synthetic_kv(layers: int, hidden: int, tokens: int = CHUNK, seed: int = 0) -> torch.Tensor:
    """KV_BLOB [2, layers, tokens, hidden] bf16 with real KV's traits (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.randn(2, layers, 1, hidden, generator=g)
    offsets = torch.where(torch.rand(2, layers, 1, hidden, generator=g) < 0.05, offsets * 20, offsets)
    token_scale = torch.exp(torch.randn(2, layers, tokens, 1, generator=g) * 0.6)
    u = torch.rand(2, layers, tokens, hidden, generator=g) - 0.5
    noise = -torch.sign(u) * torch.log1p(-2 * u.abs())
    smooth = torch.cumsum(torch.randn(2, layers, tokens, hidden, generator=g) * 0.1, dim=2)
    return (offsets + token_scale * noise + smooth).to(torch.bfloat16)


def round_trip_error(chunk: torch.Tensor, shape: tuple[int, int, int]) -> float:
    """RMS error of one GPU-coded round trip, relative to the RMS of the chunk around its channel
    means (the quantizer's scale)."""
    ser, de = serde_pair("gpu-check", shape, None)
    out = de.from_bytes(ser.to_bytes(chunk.cuda())).float().cpu()
    x = chunk.float()
    centered = x - x.mean(dim=2, keepdim=True)
    return float((out - x).square().mean().sqrt() / centered.square().mean().sqrt())


def save_kv(path: Path) -> None:
    from cachegen_common import kv_8b_like

    smol = kv_8b_like(8192)[:, :30, :CHUNK, :192].contiguous().clone()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(smol, path)
    print(f"wrote {path}: SmolLM2 KV {tuple(smol.shape)} {smol.dtype}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv", type=Path, default=Path(".whl/cachegen_kv_smollm2_256.pt"),
                    help="real SmolLM2 KV [2, 30, 256, 192] (see --save-kv)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path, default=OUT, help="folder for cachegen_gpu_coder.json")
    ap.add_argument("--save-kv", type=Path, default=None, help="write the KV file and exit")
    args = ap.parse_args()
    if args.save_kv:
        save_kv(args.save_kv)
        return
    from lmcache.cachegen import gpu

    result: dict = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "goal_GBps": GOAL_GBPS}
    if args.kv.is_file():
        smol = torch.load(args.kv)
        result["kv"] = f"real SmolLM2-135M KV ({args.kv.name}); 8B-like tiled from it"
    else:
        smol = synthetic_kv(SMOL[0], SMOL[1] * SMOL[2])
        result["kv"] = f"synthetic ({args.kv} not found)"
    sets = {"SmolLM2-135M": (SMOL, smol),
            "8B-like": (BIG, tile_8b_like(smol) if args.kv.is_file() else synthetic_kv(32, 1024))}
    if not gpu.available():
        why = "no CUDA device" if not torch.cuda.is_available() else "nvCOMP (nvidia.nvcomp) not importable"
        result["rows"] = f"not measured: {why}"
        print(f"cachegen_gpu_coder: {result['rows']}")
    else:
        result["device"] = torch.cuda.get_device_name()
        result["nvcomp"] = getattr(gpu._module(), "__version__", "?")
        rows = {}
        for name, (shape, chunk) in sets.items():
            row = measure_gpu([chunk], shape, args.repeats)
            row["chunk_MB"] = chunk.numel() * 2 / 1e6
            row["relative_rms_error"] = round_trip_error(chunk, shape)
            row["meets_goal"] = row["encode_GBps"] >= GOAL_GBPS and row["decode_GBps"] >= GOAL_GBPS
            rows[name] = row
            print(f"GPU coder ({row['device']}, nvCOMP {result['nvcomp']}), {name} 256-token chunk "
                  f"({row['chunk_MB']:.1f} MB): {row['bits_per_value']:.3f} bits/value, encode "
                  f"{row['encode_GBps']:.1f} GB/s, decode {row['decode_GBps']:.1f} GB/s (goal >= "
                  f"{GOAL_GBPS:.0f}), relative RMS error {row['relative_rms_error']:.4f}", flush=True)
        result["rows"] = rows
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cachegen_gpu_coder.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out / 'cachegen_gpu_coder.json'}")


if __name__ == "__main__":
    main()
