"""The cache server's shared-memory arena: created by one process, written and read by another,
lazy (pages exist once written), removed by its owner, and removed by the next server when its
owner died without closing it."""

from __future__ import annotations

import errno
import gc
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmcache.cache_server import shm
from lmcache.cache_server.shm import SharedArena

MB = 1 << 20

CHILD = """
import sys, torch
from lmcache.cache_server.shm import SharedArena
arena = SharedArena.attach(sys.argv[1], int(sys.argv[2]))
seen = int(arena.tensor[:4096].sum())
arena.tensor[4096:8192] = 7
print(seen, flush=True)
arena.close()
"""


def ours() -> set[str]:
    return {p.name for p in shm.SHM_DIR.glob(f"{shm.PREFIX}-{os.getpid()}-*")}


@pytest.fixture
def arena():
    a = SharedArena.create(64 * MB)
    yield a
    a.close()
    a.close()
    assert a.name not in ours()


def test_another_process_reads_and_writes_the_same_bytes(arena):
    arena.tensor[:4096] = 1
    out = subprocess.run([sys.executable, "-c", CHILD, arena.name, str(arena.size)], capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.split() == ["4096"]
    assert torch.all(arena.tensor[4096:8192] == 7)
    assert arena.name in ours()  # the attached process closing it does not remove it


def mappings_of(name: str) -> int:
    return sum(name in line for line in Path("/proc/self/maps").read_text().splitlines())


def test_a_view_outliving_its_arena_keeps_the_pages_mapped_until_it_goes(arena):
    """A slot's tensor may outlive the attachment it came from (an engine detached meanwhile):
    closing the arena must not unmap pages a view still reads or writes."""
    arena.tensor[:4096] = 5
    attached = SharedArena.attach(arena.name, arena.size)
    view = attached.tensor[:4096]
    attached.close()
    gc.collect()
    assert mappings_of(arena.name) == 2  # the owner's and the view's
    assert int(view.sum()) == 5 * 4096
    view[:] = 6
    assert int(arena.tensor[:4096].sum()) == 6 * 4096
    del view
    gc.collect()
    assert mappings_of(arena.name) == 1  # the last view took its mapping with it


def test_pages_exist_only_once_written(arena):
    assert arena.resident_bytes() == 0
    arena.tensor[: 8 * MB] = 1
    assert 8 * MB <= arena.resident_bytes() < 12 * MB


@pytest.mark.parametrize("name", ["../etc/passwd", "lmcache-l1-1-zzzz", "other-segment", f"{shm.PREFIX}-1"])
def test_attach_refuses_names_that_are_not_arenas(name):
    with pytest.raises(ValueError, match="not an LMCache shared arena name"):
        SharedArena.attach(name, MB)


def test_attach_refuses_a_wrong_size_and_a_missing_segment(arena):
    with pytest.raises(ValueError, match="expected"):
        SharedArena.attach(arena.name, arena.size + MB)
    with pytest.raises(FileNotFoundError):
        SharedArena.attach(f"{shm.PREFIX}-{os.getpid()}-{'0' * 12}", MB)


def test_a_segment_whose_creator_was_killed_is_removed_and_live_ones_are_kept(arena):
    creator = subprocess.Popen([sys.executable, "-c",
                                "import sys, time; from lmcache.cache_server.shm import "
                                "SharedArena; a = SharedArena.create(1 << 20); print(a.name, flush=True); "
                                "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert creator.stdout is not None
    orphan = creator.stdout.readline().strip()
    assert (shm.SHM_DIR / orphan).exists()
    os.kill(creator.pid, signal.SIGKILL)
    creator.wait(10)
    assert orphan in shm.remove_stale()
    assert not (shm.SHM_DIR / orphan).exists() and arena.name in ours()


def test_a_size_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="> 0 bytes"):
        SharedArena.create(0)


UNMAPPABLE = """
import os, resource
from lmcache.cache_server import shm
from lmcache.cache_server.shm import SharedArena
status = open("/proc/self/status").read()
mapped = int(status.split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (mapped + (256 << 20), resource.RLIM_INFINITY))
try:
    SharedArena.create(4 << 30)  # sized, but more than this process may map
except OSError as e:
    print(e.errno)
left = list(shm.SHM_DIR.glob(f"{shm.PREFIX}-{os.getpid()}-*"))
print(len(left))
for path in left:  # not to leave it behind however the test ends
    path.unlink()
"""


def test_a_segment_that_cannot_be_mapped_is_removed():
    out = subprocess.run([sys.executable, "-c", UNMAPPABLE], capture_output=True, text=True, timeout=60,
                         check=True)
    assert out.stdout.split() == [str(errno.ENOMEM), "0"], out.stderr
