"""`CompletionWorker`: runs each issued copy's `on_done` once its CUDA event has completed.

One daemon thread per worker takes (event, on_done) in submission order, waits on the event (the
wait releases the GIL) and calls ``on_done(None)``, or ``on_done(error)`` if the wait failed. The
callback runs in inference mode, like the engine's own store/retrieve. `drain` waits until every
submitted callback has run.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import torch

from lmcache.gpu_connector.interface import CopyDone

logger = logging.getLogger(__name__)


class CompletionWorker:
    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Any, CopyDone]] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._thread: threading.Thread | None = None

    def submit(self, event: Any, on_done: CopyDone) -> None:
        """`event`: a recorded ``torch.cuda.Event`` that completes with the copy."""
        with self._idle:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put((event, on_done))

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted `on_done` has run; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def _run(self) -> None:
        while True:
            event, on_done = self._queue.get()
            error: BaseException | None = None
            try:
                event.synchronize()
            except Exception as e:  # noqa: BLE001 - a failed copy is reported to its owner
                error = e
            try:
                with torch.inference_mode():
                    on_done(error)
            except Exception:
                logger.exception("a KV copy completion callback failed")
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
