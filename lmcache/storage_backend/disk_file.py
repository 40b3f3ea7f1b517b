"""The disk tier's files: their atomic write and verified read.

One file per chunk, `<stem>.kvc`, holding a keyed blob (`serde.keyed_blob`):

    b"LMCK" | u32 key length | key (UTF-8) | blob (serde header with checksum + payload)

- `write_atomic` writes to a uniquely named temporary file in the same directory
  (`<stem>.<pid>.<token><random>.tmp`), optionally fsyncs it (and the directory), then
  `os.replace`s it onto the final name: a reader sees no file or a complete one, whoever writes
  and however a writer dies. `is_stale_tmp` tells which temporary files a dead writer left.
- With sealing on (`kv_encryption_key`) the blob is sealed for the key (`serde.seal`).
- `read_chunk` checks the key, then reads (and opens) the blob (for a raw serde the payload goes straight into
  the new buffer, hashed piece by piece). Anything that does not verify raises CorruptBlobError
  (ForeignSerdeError for an intact file of another serde).
"""

from __future__ import annotations

import io
import os
import time

from lmcache.memory_management import MemoryObj
from lmcache.storage_backend.serde import keyed_blob
from lmcache.storage_backend.serde.seal import Sealer
from lmcache.storage_backend.serde.serde import AllocateFn, Deserializer
from lmcache.write_parts import Buffer, Parts

SUFFIX = ".kvc"
TMP_SUFFIX = ".tmp"
MIN_FILE_SIZE = keyed_blob.MIN_SIZE
STALE_TMP_SECONDS = 600.0
_PROCESS_TOKEN = os.urandom(4).hex()  # tells this process's temporary files from a dead namesake's


def write_atomic(directory: str, stem: str, parts: Parts, fsync: bool) -> None:
    final = os.path.join(directory, stem + SUFFIX)
    tmp = os.path.join(directory, f"{stem}.{os.getpid()}.{_PROCESS_TOKEN}{os.urandom(6).hex()}{TMP_SUFFIX}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for part in parts:
                _write_all(fd, part)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        if fsync:
            _fsync_dir(directory)
    except BaseException:
        unlink_quietly(tmp)
        raise


def read_chunk(f: io.FileIO, key_bytes: bytes, serde_id: int, deser: Deserializer,
               allocate: AllocateFn, sealer: Sealer | None = None) -> MemoryObj | None:
    """The chunk in `f` (an unbuffered file positioned at 0) in a buffer from `allocate`, or None
    if `allocate` has no room. Raises CorruptBlobError if the file does not verify."""
    file_size = os.fstat(f.fileno()).st_size
    return keyed_blob.read_keyed_blob(f, file_size, key_bytes, serde_id, deser, allocate, sealer)


def is_stale_tmp(name: str, mtime: float) -> bool:
    """A temporary file whose writer process is gone (or that is far too old to be in progress)."""
    if time.time() - mtime > STALE_TMP_SECONDS:
        return True
    parts = name.split(".")
    if len(parts) != 4 or not parts[1].isdigit():
        return True
    pid = int(parts[1])
    if pid == os.getpid():
        return not parts[2].startswith(_PROCESS_TOKEN)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _write_all(fd: int, data: Buffer) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
