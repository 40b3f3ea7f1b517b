"""How fast is CacheGen on the CPU, as a user sees it: `CacheGenSerializer.to_bytes` and
`CacheGenDeserializer.from_bytes_to` (decode into an arena buffer) of whole 256-token chunks.

Chunks: real SmolLM2-135M KV (Moby-Dick context; 30 layers x 192 channels, 5.9 MB bf16 each) and
8B-like KV (SmolLM2's real KV laid out as 32 layers x 1,024 channels, `cachegen_common.kv_8b_like`;
33.5 MB each). For
each, the native kernels (`lmcache/native/cachegen_kernels.c`, OpenMP over torch's thread count)
and the numpy reference (the fallback without a C compiler) encode and decode the same chunk; the
two must produce the same bytes and the same KV (checked). Native timings: median of --repeats,
encode and decode alternating; reference: one run (it is ~50x slower). MB/s of bf16 input.

Where CUDA and nvCOMP (`lmcache[gpu]`) are present, the GPU coder (`lmcache.cachegen.gpu`) is measured
on the same chunks moved to the device: `to_bytes` of a CUDA chunk (quantize + nvCOMP encode + the
compressed bytes to the host) and decode of its stream to a CUDA tensor (host bytes to the
device + nvCOMP decode + dequantize), with its bits/value; otherwise that row says why it is
missing.

    PYTHONPATH=. python benchmarks/cachegen_coder_speed.py [--chunks 4] [--repeats 7] [--threads 2]

`--against DIR` compares with another checkout's CacheGen (e.g. the constriction coder before
issue 12: ``git archive 31cae3f lmcache | tar -x -C DIR``) on the same chunks, as users see it
(`to_bytes`, `from_bytes_to`): `--rounds` rounds, each running one worker process per version in
turn, so both see the same machine conditions; medians and ratios.

Prints a table and writes benchmarks/out/cachegen_coder_speed.json (or _ab.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from cachegen_common import EVAL_TEXTS, KVModel, kv_8b_like

from lmcache.cachegen.serde import CacheGenDeserializer, CacheGenSerializer
from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.memory_management import HostMemoryAllocator, MemoryFormat, MemoryObj, TensorMemoryAllocator

# `--worker` runs with another checkout's lmcache too: only names every version has are imported
# at the top; this checkout's coder modules are imported where they are used.

OUT = Path(__file__).with_name("out")
CHUNK = 256


def serde_pair(name: str, shape: tuple[int, int, int], coder: object
               ) -> tuple[CacheGenSerializer, CacheGenDeserializer]:
    layers, heads, head = shape
    md = LMCacheEngineMetadata(name, 1, 0, "vllm", torch.bfloat16, (layers, 2, CHUNK, heads, head))
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK)
    return (CacheGenSerializer(cfg, md, coder=coder),  # type: ignore[arg-type]
            CacheGenDeserializer(cfg, md, torch.bfloat16, coder))  # type: ignore[arg-type]


def arena_buffer(shape: torch.Size) -> MemoryObj:
    """A pre-faulted arena buffer for one decoded chunk (as the tiers decode into)."""
    arena = HostMemoryAllocator(TensorMemoryAllocator.aligned_size(shape.numel() * 2))
    obj = arena.allocate(shape, torch.bfloat16, MemoryFormat.KV_BLOB)
    assert obj is not None
    return obj


def time_chunk(ser: CacheGenSerializer, de: CacheGenDeserializer, chunk: torch.Tensor, repeats: int
               ) -> tuple[float, float, bytes]:
    """Median seconds of `to_bytes` and of `from_bytes_to` (into an arena buffer) of `chunk`,
    alternating, and the serialized bytes."""
    target = arena_buffer(chunk.shape)
    per_enc, per_dec = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        data = ser.to_bytes(chunk)
        per_enc.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        obj = de.from_bytes_to(data, lambda *_, buf=target: buf)
        per_dec.append(time.perf_counter() - t0)
        assert obj is target
    return statistics.median(per_enc), statistics.median(per_dec), data


def measure(label: str, chunks: list[torch.Tensor], shape: tuple[int, int, int], repeats: int) -> dict:
    from lmcache.cachegen.kernels import NativeKernels, ReferenceKernels, kernels

    native = kernels()
    if not isinstance(native, NativeKernels):
        raise SystemExit("native kernels unavailable: nothing to measure")
    ser, de = serde_pair(label, shape, native)
    ref_ser, ref_de = serde_pair(label, shape, ReferenceKernels())
    enc, dec, nbytes, values, blob_bytes = [], [], 0, 0, 0
    for chunk in chunks:
        t_enc, t_dec, data = time_chunk(ser, de, chunk, repeats)
        enc.append(t_enc)
        dec.append(t_dec)
        nbytes += chunk.numel() * 2
        values += chunk.numel()
        blob_bytes += len(data)
    chunk = chunks[0]
    t0 = time.perf_counter()
    ref_data = ref_ser.to_bytes(chunk)
    ref_enc = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref_kv = ref_de.from_bytes(ref_data)
    ref_dec = time.perf_counter() - t0
    identical = ref_data == ser.to_bytes(chunk) and torch.equal(ref_kv, de.from_bytes(ref_data))
    mb = nbytes / 1e6
    return {"kv": label, "chunks": len(chunks), "chunk_MB": chunk.numel() * 2 / 1e6,
            "bits_per_value": 8 * blob_bytes / values,
            "native_encode_MBps": mb / sum(enc), "native_decode_MBps": mb / sum(dec),
            "reference_encode_MBps": chunk.numel() * 2 / 1e6 / ref_enc,
            "reference_decode_MBps": chunk.numel() * 2 / 1e6 / ref_dec,
            "native_equals_reference": identical}


def measure_gpu(chunks: list[torch.Tensor], shape: tuple[int, int, int], repeats: int) -> dict:
    """The GPU coder on `chunks` (moved to the CUDA device first)."""
    from lmcache.cachegen.decoder import decode_stream
    from lmcache.cachegen.encoded import CacheGenEncoderOutput
    from lmcache.cachegen.kernels import kernels
    from lmcache.storage_backend.serde import blob

    ser, _ = serde_pair("gpu", shape, kernels())
    enc, dec, nbytes, blob_bytes = [], [], 0, 0
    for chunk in chunks:
        device_chunk = chunk.cuda()
        per_enc, per_dec = [], []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            data = ser.to_bytes(device_chunk)
            per_enc.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            stream = CacheGenEncoderOutput.from_bytes(blob.unpack(data, "cachegen").payload)
            decode_stream(stream, torch.bfloat16)
            torch.cuda.synchronize()
            per_dec.append(time.perf_counter() - t0)
        enc.append(statistics.median(per_enc))
        dec.append(statistics.median(per_dec))
        nbytes += chunk.numel() * 2
        blob_bytes += len(data)
    return {"encode_GBps": nbytes / sum(enc) / 1e9, "decode_GBps": nbytes / sum(dec) / 1e9,
            "bits_per_value": 8 * blob_bytes / (nbytes / 2), "device": torch.cuda.get_device_name()}


def worker(chunks_file: str, repeats: int) -> None:
    """Time `to_bytes` / `from_bytes_to` of the saved chunks with whichever lmcache is importable."""
    saved = torch.load(chunks_file)
    out = {}
    for label, (shape, chunks) in saved.items():
        layers, heads, head = shape
        md = LMCacheEngineMetadata(label, 1, 0, "vllm", torch.bfloat16, (layers, 2, CHUNK, heads, head))
        cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK)
        ser, de = CacheGenSerializer(cfg, md), CacheGenDeserializer(cfg, md, torch.bfloat16)
        enc = dec = 0.0
        nbytes = 0
        for chunk in chunks:
            t_enc, t_dec, data = time_chunk(ser, de, chunk, repeats)
            enc += t_enc
            dec += t_dec
            nbytes += len(data)
        values = sum(c.numel() for c in chunks)
        out[label] = {"encode_MBps": 2 * values / enc / 1e6, "decode_MBps": 2 * values / dec / 1e6,
                      "bits_per_value": 8 * nbytes / values}
    print(json.dumps(out))


def compare(args: argparse.Namespace, chunk_sets: dict) -> None:
    import subprocess
    import tempfile

    here = Path(__file__).resolve()
    sources = {"this checkout": str(here.parents[1]), "--against": str(Path(args.against).resolve())}
    results: dict[str, list[dict]] = {name: [] for name in sources}
    with tempfile.TemporaryDirectory() as tmp:
        chunks_file = str(Path(tmp) / "chunks.pt")
        torch.save(chunk_sets, chunks_file)
        for r in range(args.rounds):
            for name, src in sources.items():
                env = {**__import__("os").environ, "PYTHONPATH": f"{src}:{here.parent}"}
                proc = subprocess.run([sys.executable, str(here), "--worker", chunks_file,
                                       "--repeats", str(args.repeats),
                                       "--threads", str(torch.get_num_threads())],
                                      env=env, capture_output=True, text=True, check=True)
                results[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(f"round {r} {name}: {results[name][-1]}", flush=True)
    rows = []
    for label in chunk_sets:
        row: dict = {"kv": label}
        for name in sources:
            for key in ("encode_MBps", "decode_MBps", "bits_per_value"):
                row[f"{name}: {key}"] = statistics.median(x[label][key] for x in results[name])
        row["encode_ratio"] = row["this checkout: encode_MBps"] / row["--against: encode_MBps"]
        row["decode_ratio"] = row["this checkout: decode_MBps"] / row["--against: decode_MBps"]
        rows.append(row)
        print(f"{label}: encode {row['this checkout: encode_MBps']:.0f} vs "
              f"{row['--against: encode_MBps']:.0f} MB/s ({row['encode_ratio']:.2f}x), decode "
              f"{row['this checkout: decode_MBps']:.0f} vs {row['--against: decode_MBps']:.0f} MB/s "
              f"({row['decode_ratio']:.2f}x); bits/value {row['this checkout: bits_per_value']:.3f} "
              f"vs {row['--against: bits_per_value']:.3f}")
    OUT.mkdir(exist_ok=True)
    (OUT / "cachegen_coder_speed_ab.json").write_text(json.dumps(
        {"threads": torch.get_num_threads(), "rounds": args.rounds, "repeats": args.repeats,
         "against": args.against, "rows": rows, "raw": results}, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads")
    ap.add_argument("--against", default=None, help="another checkout's root (see above)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        worker(args.worker, args.repeats)
        return
    model = KVModel()
    prompt = model.prompt(EVAL_TEXTS[0], CHUNK * args.chunks, 1)
    real = model.kv_of(prompt.context).to(torch.bfloat16)
    smol = [real[:, :, t:t + CHUNK].contiguous() for t in range(0, real.shape[2], CHUNK)]
    big = kv_8b_like(8192)[:, :, : CHUNK * args.chunks]  # the wire benchmark's KV (cached)
    big_chunks = [big[:, :, t:t + CHUNK].contiguous() for t in range(0, big.shape[2], CHUNK)]
    if args.against:
        compare(args, {"SmolLM2-135M (real KV)": ((model.num_layers, model.kv_heads, model.head_dim), smol),
                       "8B-like (real KV tiled)": ((32, 8, 128), big_chunks)})
        return
    rows = [measure("SmolLM2-135M (real KV)", smol, (model.num_layers, model.kv_heads, model.head_dim),
                    args.repeats),
            measure("8B-like (real KV tiled)", big_chunks, (32, 8, 128), args.repeats)]
    print(f"threads: {torch.get_num_threads()}")
    print(f"{'KV':24s} {'bits/val':>8s} {'enc MB/s':>9s} {'dec MB/s':>9s} {'ref enc':>8s} "
          f"{'ref dec':>8s} {'identical':>9s}")
    for r in rows:
        print(f"{r['kv']:24s} {r['bits_per_value']:8.3f} {r['native_encode_MBps']:9.0f} "
              f"{r['native_decode_MBps']:9.0f} {r['reference_encode_MBps']:8.1f} "
              f"{r['reference_decode_MBps']:8.1f} {r['native_equals_reference']!s:>9s}")
    from lmcache.cachegen import gpu

    gpu_rows: dict[str, dict] | str
    if gpu.available():
        gpu_rows = {"SmolLM2-135M (real KV)": measure_gpu(smol, (model.num_layers, model.kv_heads,
                                                                 model.head_dim), args.repeats),
                    "8B-like (real KV tiled)": measure_gpu(big_chunks, (32, 8, 128), args.repeats)}
        for name, r in gpu_rows.items():
            print(f"GPU coder ({r['device']}), {name}: {r['bits_per_value']:.3f} bits/value, "
                  f"encode {r['encode_GBps']:.1f} GB/s, decode {r['decode_GBps']:.1f} GB/s")
    else:
        gpu_rows = "not measured: needs a CUDA device and nvCOMP (pip install 'lmcache[gpu]')"
        print(f"GPU coder: {gpu_rows}")
    OUT.mkdir(exist_ok=True)
    (OUT / "cachegen_coder_speed.json").write_text(json.dumps(
        {"threads": torch.get_num_threads(), "chunks": args.chunks, "repeats": args.repeats,
         "rows": rows, "gpu": gpu_rows}, indent=2))


if __name__ == "__main__":
    main()
