"""`LocalDiskBackend` ("LocalDiskBackend"): KV chunks as files in `config.local_disk`.

One file per chunk, named by the xxh3-128 of the key string (`<hash>.kvc`), holding

    b"LMCK" | u32 key length | key (UTF-8) | blob (serde header with checksum + payload)

- Writes run on the put workers (`LowerTierBackend`): the blob goes to a uniquely named temporary
  file in the same directory (`<hash>.<pid>.<random>.tmp`), optionally `fsync`ed
  (`local_disk_fsync`), then `os.replace`d onto the final name. A reader therefore sees either no
  file or a complete one, also when several processes (tensor-parallel ranks, two engines) share
  the directory or a writer is killed halfway; the worst left behind is a temporary file, which
  `load_disk` removes once its writer is gone.
- The directory is the persistent index: `load_disk` (run at start-up) scans it and rebuilds the
  in-memory LRU index from file sizes and modification times; `contains` also finds files that
  other processes wrote since (one `stat`).
- `max_local_disk_size` bounds the bytes this process knows of; room for a new file is made by
  unlinking least recently used files (safe while another process still reads them).
- Reads verify the key and the blob checksum; a truncated, bit-flipped or foreign file is removed
  and counted (`num_corrupt`) and the read is a miss. With a raw serde (`naive`, `fast`) the
  payload is read straight into the buffer from `allocate`, with no intermediate copy.
"""

from __future__ import annotations

import io
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

import xxhash

from lmcache.config import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache.memory_management import MemoryFormat, MemoryObj
from lmcache.storage_backend.lower_tier import LowerTierBackend, TierPools
from lmcache.storage_backend.serde import CorruptBlobError, ForeignSerdeError, create_serde
from lmcache.storage_backend.serde import blob as blob_header
from lmcache.storage_backend.serde.serde import AllocateFn
from lmcache.utils import CacheEngineKey

logger = logging.getLogger(__name__)

FILE_MAGIC = b"LMCK"
_PREFIX = struct.Struct("<4sI")
MAX_KEY_BYTES = 4096
SUFFIX = ".kvc"
TMP_SUFFIX = ".tmp"
STALE_TMP_SECONDS = 600.0
READ_PIECE = 1 << 20  # read + hash in pieces small enough to still be in L2 when hashed
_PROCESS_TOKEN = os.urandom(4).hex()  # tells this process's temporary files from a dead namesake's


class LocalDiskBackend(LowerTierBackend):
    name = "LocalDiskBackend"

    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata,
                 allocate: AllocateFn, pools: TierPools | None = None) -> None:
        if config.local_disk is None:
            raise ValueError("LocalDiskBackend needs config.local_disk (a directory)")
        if config.max_local_disk_bytes <= 0:
            raise ValueError(f"max_local_disk_size={config.max_local_disk_size} GB: the disk tier "
                             f"at {config.local_disk!r} needs a size limit > 0")
        self.path = os.path.abspath(config.local_disk)
        os.makedirs(self.path, exist_ok=True)
        self.max_bytes = config.max_local_disk_bytes
        self.fsync = config.local_disk_fsync
        self.serde_name = config.local_disk_serde
        self.serializer, self.deserializer = create_serde(self.serde_name, config, metadata)
        super().__init__(allocate, pools)
        self._index: OrderedDict[str, int] = OrderedDict()  # file stem -> bytes, LRU first
        self._index_lock = threading.Lock()
        self.used_bytes = 0
        self._reserved_bytes = 0
        self.num_corrupt = 0
        self.num_evicted = 0
        self.num_too_large = 0
        self.load_disk()

    # ---- naming ---------------------------------------------------------------------------------

    @staticmethod
    def _stem(key: CacheEngineKey) -> str:
        return xxhash.xxh3_128_hexdigest(key.to_string().encode())

    def _key_to_path(self, key: CacheEngineKey) -> str:
        return os.path.join(self.path, self._stem(key) + SUFFIX)

    # ---- index ----------------------------------------------------------------------------------

    def contains(self, key: CacheEngineKey) -> bool:
        stem = self._stem(key)
        with self._index_lock:
            if stem in self._index:
                return True
        try:  # written by another process sharing the directory?
            size = os.stat(os.path.join(self.path, stem + SUFFIX)).st_size
        except FileNotFoundError:
            return False
        self._insert_stem(stem, size)
        return True

    def insert_key(self, key: CacheEngineKey, size: int) -> None:
        """Record that `key`'s file (of `size` bytes) is on disk."""
        self._insert_stem(self._stem(key), size)

    def _insert_stem(self, stem: str, size: int) -> None:
        with self._index_lock:
            self.used_bytes += size - self._index.pop(stem, 0)
            self._index[stem] = size
            victims = self._take_victims(0, keep=stem)
        self._unlink_all(victims)

    def _touch(self, stem: str) -> None:
        with self._index_lock:
            if stem in self._index:
                self._index.move_to_end(stem)

    def _forget(self, stem: str) -> None:
        with self._index_lock:
            self.used_bytes -= self._index.pop(stem, 0)

    def _take_victims(self, incoming: int, keep: str | None = None) -> list[str]:
        """Under the index lock: drop LRU entries until `incoming` more bytes fit."""
        victims = []
        for stem in list(self._index):
            if self.used_bytes + self._reserved_bytes + incoming <= self.max_bytes:
                break
            if stem == keep:
                continue
            self.used_bytes -= self._index.pop(stem)
            victims.append(stem)
        self.num_evicted += len(victims)
        return victims

    def _unlink_all(self, stems: list[str]) -> None:
        for stem in stems:
            try:
                os.unlink(os.path.join(self.path, stem + SUFFIX))
            except FileNotFoundError:
                pass

    def remove(self, key: CacheEngineKey) -> bool:
        stem = self._stem(key)
        self._forget(stem)
        try:
            os.unlink(os.path.join(self.path, stem + SUFFIX))
        except FileNotFoundError:
            return False
        return True

    def load_disk(self) -> int:
        """Rebuild the index from the directory (oldest modification first = first to evict) and
        remove temporary files whose writer is gone; returns the number of entries found."""
        found: list[tuple[float, str, int]] = []
        for entry in os.scandir(self.path):
            name = entry.name
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            if name.endswith(SUFFIX):
                if st.st_size < _PREFIX.size + blob_header.HEADER_SIZE:
                    _unlink_quietly(entry.path)  # cannot even hold a header: a foreign or torn file
                    continue
                found.append((st.st_mtime, name[: -len(SUFFIX)], st.st_size))
            elif name.endswith(TMP_SUFFIX) and _stale_tmp(name, st.st_mtime):
                _unlink_quietly(entry.path)
        found.sort()
        with self._index_lock:
            for _, stem, size in found:
                self.used_bytes += size - self._index.pop(stem, 0)
                self._index[stem] = size
            victims = self._take_victims(0)
        self._unlink_all(victims)
        return len(self._index)

    # ---- writes ---------------------------------------------------------------------------------

    def _should_put(self, key: CacheEngineKey) -> bool:
        return not self.contains(key)

    def _write(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        self.async_save_bytes_to_disk(key, obj)

    def async_save_bytes_to_disk(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        """Write `memory_obj` as `key`'s file (temporary file + atomic rename); runs on a put
        worker. Skipped (counted in `num_too_large`) if it cannot fit in `max_local_disk_size`."""
        tensor = memory_obj.tensor
        if tensor is None:
            raise ValueError(f"the disk tier stores tensors; got a {memory_obj.get_memory_format()} object")
        key_bytes = key.to_string().encode()
        parts = [_PREFIX.pack(FILE_MAGIC, len(key_bytes)), key_bytes,
                 *self.serializer.to_parts(tensor)]
        size = sum(len(p) for p in parts)
        if not self._reserve(size):
            return
        stem = self._stem(key)
        final = os.path.join(self.path, stem + SUFFIX)
        tmp = os.path.join(self.path,
                           f"{stem}.{os.getpid()}.{_PROCESS_TOKEN}{os.urandom(6).hex()}{TMP_SUFFIX}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for part in parts:
                    _write_all(fd, part)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            if self.fsync:
                _fsync_dir(self.path)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        finally:
            with self._index_lock:
                self._reserved_bytes -= size
        self._insert_stem(stem, size)

    def _reserve(self, size: int) -> bool:
        with self._index_lock:
            if size > self.max_bytes:
                self.num_too_large += 1
                return False
            victims = self._take_victims(size)
            self._reserved_bytes += size
        self._unlink_all(victims)
        return True

    # ---- reads ----------------------------------------------------------------------------------

    def _read(self, key: CacheEngineKey) -> MemoryObj | None:
        return self.load_bytes_from_disk(key)

    def async_load_bytes_from_disk(self, key: CacheEngineKey) -> Future:
        """`load_bytes_from_disk(key)` on the load pool."""
        return self._loads.submit(self.load_bytes_from_disk, key)

    def load_bytes_from_disk(self, key: CacheEngineKey) -> MemoryObj | None:
        """`key`'s chunk in a buffer from `allocate` (reference owned by the caller), or None if
        it is not on disk, is corrupt (then the file is removed) or `allocate` has no room."""
        stem = self._stem(key)
        path = os.path.join(self.path, stem + SUFFIX)
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            self._forget(stem)
            return None
        try:
            with f:
                obj = self._read_file(f, key)
        except ForeignSerdeError:
            return None  # written by a process with another local_disk_serde: a miss, kept
        except CorruptBlobError as e:
            logger.warning("removing corrupt disk cache file %s: %s", path, e)
            with self._index_lock:
                self.num_corrupt += 1
            self._forget(stem)
            _unlink_quietly(path)
            return None
        if obj is not None:
            self._touch(stem)
        return obj

    def _read_file(self, f: io.FileIO, key: CacheEngineKey) -> MemoryObj | None:
        file_size = os.fstat(f.fileno()).st_size
        magic, key_len = _PREFIX.unpack(_read_exact(f, _PREFIX.size))
        if magic != FILE_MAGIC or key_len > MAX_KEY_BYTES:
            raise CorruptBlobError("not an LMCache disk cache file (bad magic or key length)")
        if _read_exact(f, key_len) != key.to_string().encode():
            raise CorruptBlobError("the file holds a different key")
        head = _read_exact(f, blob_header.HEADER_SIZE)
        header = blob_header.parse_header(head)
        if file_size != _PREFIX.size + key_len + blob_header.HEADER_SIZE + header.payload_len:
            raise CorruptBlobError(f"file has {file_size} bytes, its header describes "
                                   f"{_PREFIX.size + key_len + blob_header.HEADER_SIZE + header.payload_len}")
        deser = self.deserializer
        ours = header.serde_id == blob_header.SERDE_IDS[self.serde_name]
        if not (ours and deser.raw_payload and header.dtype == deser.dtype):
            return deser.from_bytes_to(head + f.read(), self.allocate)
        if header.shape.numel() * header.dtype.itemsize != header.payload_len:
            raise CorruptBlobError(f"payload of {header.payload_len} bytes does not hold "
                                   f"{header.dtype} {tuple(header.shape)}")
        obj = self.allocate(header.shape, header.dtype, MemoryFormat.KV_BLOB)
        if obj is None:
            return None
        try:
            verifier = blob_header.PayloadVerifier(head, header)
            _readinto_exact(f, obj.byte_array, verifier)
            verifier.finish()
        except BaseException:
            obj.ref_count_down()
            raise
        return obj


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read_exact(f: io.FileIO, n: int) -> bytes:
    data = f.read(n)
    if data is None or len(data) != n:
        raise CorruptBlobError(f"file is truncated (wanted {n} more bytes)")
    return data


def _readinto_exact(f: io.FileIO, buf: memoryview, verifier: blob_header.PayloadVerifier) -> None:
    """Fill `buf` from `f` in READ_PIECE pieces, hashing each while it is still in cache."""
    view = buf.cast("B") if buf.format != "B" else buf
    while view:
        n = f.readinto(view[:READ_PIECE])
        if not n:
            raise CorruptBlobError("file is truncated")
        verifier.update(view[:n])
        view = view[n:]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _stale_tmp(name: str, mtime: float) -> bool:
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
