"""The tests' server processes: their start-up wait tells a slow start from a hung one by the CPU
they use (a start that keeps working is waited for, one that sleeps fails early), a server a
failed test left running is stopped at the session's end, a server started at a lower priority is
niced where the scheduler weighs it, its session, and a thread that polls without pause is found
and niced below the threads that work."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.openai_server import nice_session, renice_pollers
from tests.helpers.servers import CpuProgress, LMServer, process_group, stop_leftovers


@pytest.fixture
def group(request):
    code = request.param
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("group", ["while True: pass"], indirect=True)
def test_a_group_that_keeps_a_core_busy_is_not_stalled(group):
    progress = CpuProgress(lambda: process_group(group.pid))
    time.sleep(6.0)
    # a sleeping group would show 6 s; a busy one used a CPU second in them (a sixth of a core
    # would do, however loaded the machine) and shows none
    assert progress.stalled_for() < 1.0


@pytest.mark.parametrize("group", ["import time; time.sleep(60)"], indirect=True)
def test_a_group_that_sleeps_is_stalled_for_as_long_as_it_sleeps(group):
    time.sleep(0.5)  # past the interpreter's start
    progress = CpuProgress(lambda: process_group(group.pid))
    time.sleep(2.0)
    assert progress.stalled_for() >= 2.0


def test_a_server_a_test_left_running_is_stopped_by_sigterm_at_the_sessions_end():
    left = LMServer().start()  # and never stopped, as by a test that failed before its clean-up
    assert left.proc is not None and left.proc.poll() is None
    stop_leftovers()
    assert left.proc.returncode == 0  # SIGTERM: a server that stops cleanly exits 0


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="this kernel has no autogroups")
@pytest.mark.parametrize("group", ["import time; time.sleep(60)"], indirect=True)
def test_a_niced_session_is_niced_for_the_scheduler_too(group):
    nice_session(group.pid, 10)
    assert Path(f"/proc/{group.pid}/autogroup").read_text().split()[-1] == "10"


POLLER = """
import threading, time
def poll():
    print(threading.get_native_id(), flush=True)
    while True:
        pass
threading.Thread(target=poll, daemon=True).start()
time.sleep(60)
"""


def test_the_thread_that_polls_is_reniced_and_the_others_are_not():
    proc = subprocess.Popen([sys.executable, "-c", POLLER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        poller = int(proc.stdout.readline())
        assert renice_pollers([proc.pid]) == [poller]
        assert os.getpriority(os.PRIO_PROCESS, poller) == 19
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == os.getpriority(os.PRIO_PROCESS, 0)  # main thread
    finally:
        proc.kill()
        proc.wait()
