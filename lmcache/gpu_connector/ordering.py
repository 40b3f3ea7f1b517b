"""How the staged copy orders its work on a device: `CudaOrdering` (streams and events) or
`HostOrdering` (every operation has completed when its call returns).

The staged pipeline (`staged.StagedCopier`) is written once against these few calls, so the code
that issues a CUDA request is the code CI runs on the CPU:

- ``current()`` / ``new_stream()``: the caller's current stream / a side stream;
- ``use(stream)``: run the enclosed torch ops (and Triton launches) on `stream`;
- ``record(stream)``: an event completing with the work issued on `stream` so far;
- ``wait(stream, event)``: later work on `stream` waits for `event` (None: nothing to wait for);
- ``synchronize(stream)`` / ``host_wait(event)``: block the host;
- ``complete(event, on_done)``: call ``on_done(None)`` once `event` has completed (CUDA: on the
  completion thread; host: now); ``drain()`` waits for all of those.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from lmcache.gpu_connector.completion import CompletionWorker
from lmcache.gpu_connector.interface import CopyDone


class HostOrdering:
    pin_tables = False

    def current(self) -> Any:
        return None

    def new_stream(self) -> Any:
        return None

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def record(self, stream: Any) -> Any:
        return None

    def wait(self, stream: Any, event: Any) -> None:
        pass

    def synchronize(self, stream: Any) -> None:
        pass

    def host_wait(self, event: Any) -> None:
        pass

    def complete(self, event: Any, on_done: CopyDone) -> None:
        on_done(None)

    def drain(self, timeout: float | None = None) -> bool:
        return True


class CudaOrdering:
    pin_tables = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._completions = CompletionWorker(f"lmcache-kv-copies-{device}")

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def use(self, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        return stream.record_event()

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event | None) -> None:
        if event is not None:
            stream.wait_event(event)

    def synchronize(self, stream: torch.cuda.Stream) -> None:
        stream.synchronize()

    def host_wait(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.synchronize()

    def complete(self, event: torch.cuda.Event, on_done: CopyDone) -> None:
        self._completions.submit(event, on_done)

    def drain(self, timeout: float | None = None) -> bool:
        return self._completions.drain(timeout)


def ordering_for(device: torch.device) -> HostOrdering | CudaOrdering:
    return CudaOrdering(device) if device.type == "cuda" else HostOrdering()
