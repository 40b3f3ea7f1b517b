"""The planted wrong layout (`tests.helpers.planted_faults`) changes one layer of what a store
copies, in a process started under its environment, and nothing else."""

import os
import subprocess
import sys

import pytest

from tests.helpers.planted_faults import LAYER_ENV, wrong_layout_env

GATHER = """
import torch
from lmcache.integration.vllm.cpu_connector import VLLMCPUPackedConnector
from lmcache.integration.vllm.cpu_layout import closed_form_layout
from lmcache.memory_management import HostMemoryAllocator, MemoryFormat

lay = closed_form_layout(2, 8, 16, "vec")
conn = VLLMCPUPackedConnector(16, 3, lay)
gen = torch.Generator().manual_seed(0)
caches = [torch.randn(4, 2, 16, 16, generator=gen) for _ in range(3)]
obj = HostMemoryAllocator(1 << 20).allocate(conn.get_shape(32), torch.float32, MemoryFormat.KV_BLOB)
conn.batched_from_gpu([obj], [0], [32], kvcaches=caches, slot_mapping=torch.arange(16, 48))
torch.save(obj.tensor.clone(), {path!r})
"""


def gathered(tmp_path, env: dict[str, str], name: str):
    import torch

    path = tmp_path / f"{name}.pt"
    full = {**os.environ, **env}
    subprocess.run([sys.executable, "-c", GATHER.format(path=str(path))], env=full, check=True,
                   timeout=600)  # a bound for a hung process only
    return torch.load(path)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return gathered(tmp_path_factory.mktemp("clean"), {}, "clean")


def test_the_wrong_layout_changes_exactly_the_planted_layer_of_a_store(tmp_path, clean):
    planted = gathered(tmp_path, wrong_layout_env(1), "planted")
    assert planted[:, 0].equal(clean[:, 0]) and planted[:, 2].equal(clean[:, 2])
    assert not planted[:, 1].equal(clean[:, 1])
    # the same values, in another order: a layout, not noise
    assert planted[:, 1].flatten().sort().values.equal(clean[:, 1].flatten().sort().values)


def test_with_a_trigger_the_fault_is_planted_only_while_its_file_exists(tmp_path, clean):
    trigger = tmp_path / "on"
    assert gathered(tmp_path, wrong_layout_env(1, trigger), "off").equal(clean)
    trigger.touch()
    assert not gathered(tmp_path, wrong_layout_env(1, trigger), "on")[:, 1].equal(clean[:, 1])


def test_the_environment_keeps_the_callers_pythonpath_after_the_hook(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = wrong_layout_env(3)
    assert env[LAYER_ENV] == "3" and env["PYTHONPATH"].endswith(os.pathsep + "/somewhere")
