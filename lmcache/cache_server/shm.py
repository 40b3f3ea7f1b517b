"""`SharedArena`: a POSIX shared-memory segment (a file in /dev/shm) mapped as a uint8 tensor, the
memory the cache server's L1 lives in and its engines copy KV into and out of.

The server `create`s the segment (its name carries the server's pid); engines `attach` to it by
name. The segment is sized with ftruncate, so its pages come into being when first written: an
arena of many GB costs nothing until it fills (the allocator over it touches it a piece at a time).
The creator unlinks the name on `close`; a segment whose creator died without closing (SIGKILL)
is removed by `remove_stale`, which a new server runs before it creates its own. Names are
checked on attach: only segments of this family, never a path.
"""

from __future__ import annotations

import mmap
import os
import re
import uuid
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
PREFIX = "lmcache-l1"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]{{12}}$")


class SharedArena:
    def __init__(self, name: str, size: int, fd: int, owner: bool) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        try:
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self._closed = False

    @classmethod
    def create(cls, size: int) -> SharedArena:
        """A new segment of `size` bytes, owned (unlinked on `close`) by this process."""
        if size <= 0:
            raise ValueError(f"a shared arena needs > 0 bytes, got {size}")
        name = f"{PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        except OSError:
            os.close(fd)
            (SHM_DIR / name).unlink(missing_ok=True)
            raise
        try:
            return cls(name, size, fd, owner=True)  # closes fd, mapped or not
        except BaseException:  # e.g. more than this process may map (ENOMEM)
            (SHM_DIR / name).unlink(missing_ok=True)
            raise

    @classmethod
    def attach(cls, name: str, size: int) -> SharedArena:
        """The segment `name` another process created; ValueError if the name is not one of ours
        or the segment is not `size` bytes, FileNotFoundError if it is gone."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{name!r} is not an LMCache shared arena name")
        fd = os.open(SHM_DIR / name, os.O_RDWR)
        actual = os.fstat(fd).st_size
        if actual != size:
            os.close(fd)
            raise ValueError(f"shared arena {name}: {actual} bytes, expected {size}")
        return cls(name, size, fd, owner=False)

    def resident_bytes(self) -> int:
        """Bytes of the segment that exist in memory (written at least once)."""
        return os.stat(SHM_DIR / self.name).st_blocks * 512

    def close(self) -> None:
        """Let go of the mapping (`tensor` is gone); the owner also removes the segment. The pages
        stay mapped while a view of them lives (each view keeps the mmap object alive) and are
        unmapped with the last: `mmap.close` would unmap them under such a view (`torch.frombuffer`
        holds the object, not a buffer export, so nothing refuses it), and the view would then
        read or write whatever is mapped there next. Closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        del self.tensor
        del self._map
        if self.owner:
            (SHM_DIR / self.name).unlink(missing_ok=True)


def remove_stale() -> list[str]:
    """Remove the segments whose creator is no longer alive; their names."""
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}-*"):
        match = _NAME.match(path.name)
        if match and not process_alive(int(match.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists (visible from here)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
