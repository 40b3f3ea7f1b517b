"""`lmcache.process_exit`: a process that exits without the interpreter's last collection."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys

from lmcache import process_exit

# an object kept alive only by a reference cycle, whose finalizer says when the collection reaches it
PROGRAM = """
import os, sys
from lmcache.process_exit import skip_final_collection

class Node:
    def __del__(self, write=os.write):
        write(1, b"collected")

node = Node()
node.self = node
del node
import gc
gc.disable()  # only the collection at exit may find it
if sys.argv[1] == "skip":
    skip_final_collection()
"""


def _exit_output(mode: str) -> str:
    done = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=60,
                          check=True)
    return done.stdout


def test_a_process_that_skips_the_final_collection_leaves_its_cycles_to_the_os():
    assert _exit_output("keep") == "collected"  # the interpreter's last collection reaches the cycle
    assert _exit_output("skip") == ""


def _registered_in_child(queue) -> None:
    process_exit.skip_final_collection_in_child()
    queue.put(process_exit._registered)


def test_only_a_process_started_by_multiprocessing_skips_it():
    process_exit.skip_final_collection_in_child()  # pytest's own process: left as it is
    assert not process_exit._registered
    ctx = multiprocessing.get_context("spawn")  # as vLLM starts its engine core and workers
    queue = ctx.Queue()
    child = ctx.Process(target=_registered_in_child, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=60) is True
    finally:
        child.join(60)
    assert child.exitcode == 0
