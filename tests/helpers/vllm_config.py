"""A stand-in for the parts of a vLLM instance's config the connector reads, for tests that build
its scheduler or worker side without vLLM."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any


def instance_config(engine_id: str = "test", *, kv_role: str = "kv_both", world_size: int = 1,
                    data_parallel_rank: int = 0) -> Any:
    """A new instance's config (its own ``instance_id`` on every call)."""
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(engine_id=engine_id, kv_role=kv_role),
                           parallel_config=SimpleNamespace(world_size=world_size,
                                                           data_parallel_rank=data_parallel_rank),
                           instance_id=uuid.uuid4().hex)
