"""Issue 36's CUDA checks in one short device run, within a hard time budget.

    python3 benchmarks/gpu_check.py [--budget-s 210] [--out $OUT] [--install env|target|none]
                                    [--tests FILE,...] [--tests-limit-s 80] [--transfer-reps 5]
                                    [--workers 4] [--profile] [--coder-repeats 10] [--prefix-reps 3]
                                    [--prefix-min-s 45]

A short second run (issue 36's fixes: the CUDA test files they touch, both transfer shapes with a
profile, the coder, the prefix case if time is left; at most ~140 s):

    python3 benchmarks/gpu_check.py --budget-s 138 --out $OUT --workers 8 --tests-limit-s 65 \
        --tests tests/unit/cachegen/test_cachegen_cuda.py,tests/unit/core/test_gpu_connector_cuda.py,\
tests/integration/vllm/test_cuda_paths.py,tests/unit/transformers/test_prefix_cache_paths.py \
        --transfer-reps 3 --profile --coder-repeats 5 --prefix-reps 2 --prefix-min-s 25

Run from the checkout's root on the GPU machine (Python 3.12, torch with CUDA, no network, no
vLLM), with the ignored folder `.whl/` carried: the wheels the machine lacks (pyzmq, redis,
hiredis, nvCOMP's `nvidia-nvcomp-cu13` + `nvidia-libnvcomp-cu13` 5.1.0.21: built with CUDA 13.0,
the driver's (580) own version, where 6.0 is built with 13.4) and CacheGen's real-KV sample
(`cachegen_kv_smollm2_256.pt`, see `cachegen_gpu_coder.py`). The package itself runs from the
checkout (PYTHONPATH=.; the native C kernels build with the machine's C compiler).

Steps, each in its own process group with its own time limit cut to what is left of the budget;
a step that fails or runs out of time does not stop the next:
1. install the wheels (`env`: into python3's own environment, a throwaway machine's; where pip
   refuses, or with `target`, into `--site` (/tmp/site) put first on PYTHONPATH);
2. the environment: GPU, driver, torch / CUDA / Triton / nvCOMP versions, C compiler;
3. the CUDA-only tests (the files and cases that skip without CUDA), JUnit XML;
4. `gpu_transfer.py`: engine store / retrieve of vLLM's paged CUDA layout vs a plain pinned <-> GPU
   copy of the same bytes, 8B-like and 70B/TP8-like shapes, 8,192 scattered tokens, bit-exact;
5. `cachegen_gpu_coder.py`: the nvCOMP coder's GB/s on 256-token chunks;
6. only if time is left: gpu_transfer's PrefixCacheLM case (random Llama, 8,192-token prompt).

Writes $OUT/gpu_check.log (everything printed), $OUT/gpu_figures.json (figures, goals, each step's
status), and the steps' own files: pytest_cuda.xml, gpu_transfer.json/.png, cachegen_gpu_coder.json,
gpu_prefix.json (at most 7 files: the device tool returns 8). Without CUDA every step reports
its skip cleanly (~2 minutes on a loaded 2-core CPU machine, nearly all of it imports).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".whl"
CUDA_TESTS = [
    "tests/unit/core/test_gpu_connector_cuda.py",
    "tests/unit/cachegen/test_cachegen_cuda.py",
    "tests/integration/vllm/test_cuda_paths.py",
    "tests/unit/core/test_memory.py::test_gpu_allocator_allocates_on_the_device",
    "tests/unit/core/test_memory.py::test_host_and_pin_allocators_allocate_and_pin_falls_back_without_cuda",
    "tests/unit/transformers/test_prefix_cache_paths.py",
]
TRANSFER_GOAL = 0.85
EXPECTED_SKIPS = ("nvCOMP present",)  # the CPU-coder fallback case, skipped where nvCOMP is
ENV_PROBE = """
import json, platform, shutil, subprocess
info = {"python": platform.python_version()}
try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout
    info["nvidia_smi"] = out.strip()
except Exception as e:
    info["nvidia_smi"] = f"unavailable: {e}"
import torch
info.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, gpu_memory_GiB=round(p.total_memory / 2**30, 1), sm_count=p.multi_processor_count,
                capability=f"{p.major}.{p.minor}")
for name in ("triton", "zmq", "redis", "xxhash", "safetensors", "transformers", "nvidia.nvcomp", "vllm"):
    try:
        mod = __import__(name, fromlist=["_"])
        info[name] = getattr(mod, "__version__", "present")
    except Exception as e:
        info[name] = f"missing: {type(e).__name__}: {e}"
info["cc"] = shutil.which("cc") or shutil.which("gcc") or "none"
try:
    import xdist
    info["xdist"] = getattr(xdist, "__version__", "present")
except ImportError:
    info["xdist"] = "missing"
from lmcache.cachegen import gpu
from lmcache.cachegen.kernels import NativeKernels, kernels
info["cachegen_gpu_coder_available"] = gpu.available()
info["native_kernels"] = isinstance(kernels(), NativeKernels)
print(json.dumps(info, indent=1))
print("ENV_JSON " + json.dumps(info))
"""


class Log:
    """Everything printed goes to stdout and to the log file as it comes."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", buffering=1)
        self.lock = threading.Lock()

    def __call__(self, text: str) -> None:
        with self.lock:
            sys.stdout.write(text + ("" if text.endswith("\n") else "\n"))
            sys.stdout.flush()
            self.file.write(text + ("" if text.endswith("\n") else "\n"))


class Runner:
    def __init__(self, log: Log, budget_s: float, env: dict[str, str]) -> None:
        self.log, self.env = log, env
        self.deadline = time.monotonic() + budget_s
        self.steps: dict[str, dict[str, Any]] = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, cmd: list[str], cap_s: float, min_s: float = 10.0,
            shown: str | None = None) -> tuple[int | None, str]:
        """Run `cmd` in ROOT for at most min(cap_s, what is left - 3 s); returns (rc or None,
        output). rc None: skipped or killed at its limit."""
        limit = min(cap_s, self.left() - 3)
        if limit < min_s:
            self.steps[name] = {"status": "skipped: out of budget", "limit_s": round(limit, 1)}
            self.log(f"=== {name}: skipped, {limit:.0f} s left of the budget")
            return None, ""
        self.log(f"=== {name} (limit {limit:.0f} s): {shown or ' '.join(cmd)}")
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace",
                                start_new_session=True)
        lines: list[str] = []
        reader = threading.Thread(target=self._pump, args=(proc.stdout, lines), daemon=True)
        reader.start()
        rc: int | None
        try:
            rc = proc.wait(timeout=limit)
            status = "ok" if rc == 0 else f"failed (rc {rc})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the step's own process group
            proc.wait()
            rc, status = None, f"timed out after {limit:.0f} s"
        reader.join(5)
        took = time.monotonic() - t0
        self.steps[name] = {"status": status, "seconds": round(took, 1), "limit_s": round(limit, 1)}
        self.log(f"=== {name}: {status} in {took:.1f} s ({self.left():.0f} s left)")
        return rc, "".join(lines)

    def _pump(self, stream: IO[str] | None, lines: list[str]) -> None:
        assert stream is not None
        for line in stream:
            lines.append(line)
            self.log(line)


def install(runner: Runner, mode: str, site: Path) -> None:
    wheels = sorted(str(p) for p in WHEELS.glob("*.whl"))
    if mode == "none" or not wheels:
        runner.steps["install"] = {"status": f"skipped ({'none asked' if wheels else 'no .whl/*.whl'})"}
        runner.log(f"=== install: {runner.steps['install']['status']}")
        return
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--disable-pip-version-check"]
    if mode == "env":
        rc, _ = runner.run("install", [*pip, *wheels], 60)
        if rc == 0:
            return
        runner.log("installing into python3's environment failed: trying --target /tmp/site")
    rc, _ = runner.run("install (target)", [*pip, "--upgrade", "--target", str(site), *wheels], 60)
    if rc == 0:
        runner.env["PYTHONPATH"] = f"{site}{os.pathsep}{runner.env['PYTHONPATH']}"


def junit_summary(path: Path) -> dict[str, Any]:
    """Counts and the names of failed / skipped cases of a JUnit XML file."""
    if not path.is_file():
        return {"error": "no JUnit XML written"}
    root = ET.parse(path).getroot()
    summary: dict[str, Any] = {"passed": [], "failed": [], "skipped": []}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            assert bad is not None
            summary["failed"].append({"test": name, "message": (bad.get("message") or "")[:300]})
        elif case.find("skipped") is not None:
            skipped = case.find("skipped")
            assert skipped is not None
            summary["skipped"].append({"test": name, "reason": (skipped.get("message") or "")[:200]})
        else:
            summary["passed"].append(name)
    summary["counts"] = {k: len(summary[k]) for k in ("passed", "failed", "skipped")}
    summary["passed"] = len(summary["passed"])
    return summary


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return {"error": f"{path.name}: {e}"}


def goals(figures: dict[str, Any]) -> dict[str, Any]:
    tests = figures["cuda_tests"]
    unexpected = [s for s in tests.get("skipped", []) if not s["reason"].startswith(EXPECTED_SKIPS)]
    out: dict[str, Any] = {
        "cuda_tests_all_pass": "counts" in tests and tests["counts"]["failed"] == 0 and not unexpected
                               and tests["counts"]["passed"] > 0,
        "cuda_tests_unexpected_skips": len(unexpected)}
    rows = figures["gpu_transfer"].get("rows") if isinstance(figures["gpu_transfer"], dict) else None
    for row in rows or []:
        out[f"transfer {row['shape']}"] = {
            "store_ratio": round(row["store_ratio"], 3), "retrieve_ratio": round(row["retrieve_ratio"], 3),
            "bit_exact": row["bit_exact"],
            "met": row["store_ratio"] >= TRANSFER_GOAL and row["retrieve_ratio"] >= TRANSFER_GOAL
                   and row["bit_exact"]}
    coder = figures["cachegen_gpu_coder"].get("rows") if isinstance(figures["cachegen_gpu_coder"], dict) \
        else None
    if isinstance(coder, dict):
        for name, row in coder.items():
            out[f"cachegen {name}"] = {"encode_GBps": round(row["encode_GBps"], 2),
                                       "decode_GBps": round(row["decode_GBps"], 2), "met": row["meets_goal"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget-s", type=float, default=210.0, help="the whole run's hard limit")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "benchmarks" / "out"))
    ap.add_argument("--install", choices=["env", "target", "none"], default="env")
    ap.add_argument("--site", type=Path, default=Path("/tmp/site"), help="the --target folder")
    ap.add_argument("--tests", default="", help="comma-separated CUDA test files / ids (default: all)")
    ap.add_argument("--tests-limit-s", type=float, default=80.0, help="the CUDA tests' time limit")
    ap.add_argument("--workers", type=int, default=4, help="pytest-xdist workers for the CUDA tests")
    ap.add_argument("--transfer-reps", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="gpu_transfer --profile (top device ops)")
    ap.add_argument("--coder-repeats", type=int, default=10)
    ap.add_argument("--prefix-reps", type=int, default=3)
    ap.add_argument("--prefix-min-s", type=float, default=45.0,
                    help="run the prefix case only if this many seconds are left")
    args = ap.parse_args()
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / "gpu_check.log")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    runner = Runner(log, args.budget_s, env)
    log(f"gpu_check: budget {args.budget_s:.0f} s, out {args.out}, python {sys.executable}, root {ROOT}")
    install(runner, args.install, args.site)

    _, probe = runner.run("environment", [sys.executable, "-c", ENV_PROBE], 40,
                          shown="python3 -c ENV_PROBE")
    env_info = next((json.loads(line[9:]) for line in probe.splitlines() if line.startswith("ENV_JSON ")),
                    {"error": "the probe printed nothing"})

    xml = args.out / "pytest_cuda.xml"
    workers = ["-n", str(args.workers)] if env_info.get("xdist") not in (None, "missing") else []  # Triton
    tests = [t for t in args.tests.split(",") if t] if args.tests else CUDA_TESTS
    runner.run("cuda tests", [sys.executable, "-m", "pytest", "-q", "-rsfE", "-p", "no:cacheprovider",
                              *workers, "--timeout", "45", f"--junitxml={xml}", *tests], args.tests_limit_s)

    py = sys.executable
    profile = ["--profile"] if args.profile else []
    runner.run("gpu_transfer", [py, "benchmarks/gpu_transfer.py", "--tokens", "8192",
                                "--reps", str(args.transfer_reps), *profile,
                                "--shapes", "8B-like,70B-TP8", "--skip-prefix", "--out", str(args.out),
                                "--budget-s", f"{max(10.0, min(35.0, runner.left() - 70)):.0f}"], 60)
    runner.run("cachegen gpu coder", [py, "benchmarks/cachegen_gpu_coder.py",
                                      "--repeats", str(args.coder_repeats),
                                      "--kv", str(WHEELS / "cachegen_kv_smollm2_256.pt"),
                                      "--out", str(args.out)], 45)
    runner.run("prefix cache (optional)", [py, "benchmarks/gpu_transfer.py", "--shapes", "",
                                           "--prefix-tokens", "8192", "--prefix-reps", str(args.prefix_reps),
                                           "--out", str(args.out), "--name", "gpu_prefix",
                                           "--budget-s", f"{max(5.0, min(40.0, runner.left() - 25)):.0f}"],
               60, min_s=args.prefix_min_s)

    transfer = read_json(args.out / "gpu_transfer.json")
    figures: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "environment": env_info,
        "cuda_tests": junit_summary(xml), "gpu_transfer": transfer,
        "cachegen_gpu_coder": read_json(args.out / "cachegen_gpu_coder.json"),
        "prefix_cache": read_json(args.out / "gpu_prefix.json").get("prefix_cache")
        if (args.out / "gpu_prefix.json").is_file() else None,
        "steps": runner.steps, "seconds": round(time.monotonic() - started, 1)}
    figures["goals"] = goals(figures)
    (args.out / "gpu_figures.json").write_text(json.dumps(figures, indent=1))
    log("=== goals: " + json.dumps(figures["goals"], indent=1))
    log(f"gpu_check: wrote {args.out / 'gpu_figures.json'} in {figures['seconds']:.0f} s")


if __name__ == "__main__":
    main()
