"""Python runs this at start-up in processes whose PYTHONPATH starts with this folder
(`lmcache.integration.vllm.cpu_build.forced_build_env`): torch's CPU feature probes named in
``LMCACHE_TORCH_CPU_PROBES`` (e.g. ``avx512,avx512_bf16,amx_tile``) answer False from now on, so
vLLM loads the kernel build of a CPU without them. Self-contained: nothing of vLLM or LMCache may be
imported before the probes are set."""

import os

_off = [name for name in os.environ.get("LMCACHE_TORCH_CPU_PROBES", "").split(",") if name]
if _off:
    import torch.cpu

    for _name in _off:
        setattr(torch.cpu, f"_is_{_name}_supported", lambda: False)
