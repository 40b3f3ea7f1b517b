"""prometheus_client's metric classes bound to a private registry, as vLLM hands them to a
connector's `LMCachePromMetrics` (tests read the samples back from that registry)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


def metric_types(registry: CollectorRegistry) -> dict[type, type]:
    """{Counter: ..., Gauge: ..., Histogram: ...}, each creating its metrics in `registry`."""

    def bound(cls: type) -> type:
        class Bound(cls):  # type: ignore[valid-type, misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    return {cls: bound(cls) for cls in (Counter, Gauge, Histogram)}
