"""The reaper `ddserve serve` starts before its local Ray: when the CLI dies, however it dies,
every process it had started is stopped (Ray's agents otherwise outlive a SIGKILLed driver)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from serve_proc import ddserve_env, session_leftovers, session_pids

PARENT = """
import subprocess, sys, time
from ddserve.serve import reaper
reaper.start()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(child.pid, flush=True)
time.sleep(300)
"""


# The parent's child starts a grandchild and exits at once, so the grandchild is reparented
# before the reaper's half-second scan can see it as a descendant (as Ray's agents are when the
# raylet dies with the driver while Ray starts): only the environment's mark finds it.
ORPHANING_PARENT = """
import subprocess, sys, time
from ddserve.serve import reaper
reaper.start()
time.sleep(1)
code = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(300)']); print(p.pid, flush=True)")
child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
print(int(child.stdout.readline()), flush=True)
child.wait()
time.sleep(300)
"""


def _start_parent(code: str = PARENT) -> tuple[subprocess.Popen, int]:
    parent = subprocess.Popen([sys.executable, "-c", code], env=ddserve_env(), text=True,
                              stdout=subprocess.PIPE, start_new_session=True)  # fmt: skip
    child = int(parent.stdout.readline())
    time.sleep(2)  # the reaper has recorded the child (it scans every 0.5 s)
    return parent, child


def _session_empty(sid: int, timeout_s: float = 20) -> bool:
    return not session_leftovers(sid, timeout_s)


def test_sigkill_of_the_parent_takes_its_descendants_down() -> None:
    parent, child = _start_parent()
    assert child in session_pids(parent.pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    assert _session_empty(parent.pid)  # the child, and the reaper itself


def test_a_signal_to_the_whole_group_does_not_stop_the_reaper_before_it_cleans_up() -> None:
    parent, child = _start_parent()
    os.killpg(parent.pid, signal.SIGTERM)  # the group the test started: parent, child, reaper
    parent.wait(10)
    assert _session_empty(parent.pid)


def _ppid(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rindex(")") + 2 :].split()[1])


def test_a_process_orphaned_before_the_reaper_saw_it_is_taken_down_too() -> None:
    parent, grandchild = _start_parent(ORPHANING_PARENT)
    assert grandchild in session_pids(parent.pid)
    assert _ppid(grandchild) != parent.pid  # reparented: not a descendant of the parent any more
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    assert _session_empty(parent.pid)
