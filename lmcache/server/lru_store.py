"""`LRUByteStore`: the lm:// server's key -> bytes map with a byte capacity and LRU eviction."""

from __future__ import annotations

from collections import OrderedDict


class LRUByteStore:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity must be > 0 bytes, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.used = 0
        self.num_evicted = 0
        self._items: OrderedDict[bytes, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: bytes, value: bytes) -> bool:
        """Store `value`, evicting least recently used entries; False if it exceeds the capacity."""
        if len(value) > self.capacity:
            return False
        self.delete(key)
        while self.used + len(value) > self.capacity:
            _, old = self._items.popitem(last=False)
            self.used -= len(old)
            self.num_evicted += 1
        self._items[key] = value
        self.used += len(value)
        return True

    def get(self, key: bytes) -> bytes | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def contains(self, key: bytes) -> bool:
        return key in self._items

    def delete(self, key: bytes) -> bool:
        value = self._items.pop(key, None)
        if value is None:
            return False
        self.used -= len(value)
        return True

    def keys(self, prefix: bytes = b"") -> list[bytes]:
        return [k for k in self._items if k.startswith(prefix)]
