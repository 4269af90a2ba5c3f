"""A process whose daemon thread is inside a store call while the interpreter tears down (tests/runtime/test_exit_code.py).

The store's host is SIGSTOPped, so the thread's call blocks; an object in a reference cycle whose finalizer runs
in the interpreter's last collection kills the host then, so the call returns in the middle of the teardown, as
an agent's beat does when its node was cut off and the agent exits fenced. argv[1]: ``exit`` (sys.exit) or
``end`` (resilient_train.base.exitfast.end_process); either with code 94. Prints the host's pid first.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from resilient_train.base.exitfast import end_process

HOST = ("import time, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, is_master=True, "
        "wait_for_workers=False); print(s.port, flush=True); time.sleep(120)")

host = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
port = int(host.stdout.readline())
print(host.pid, flush=True)  # the test kills it when this process is gone, whatever became of it
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
os.kill(host.pid, signal.SIGSTOP)
inside = threading.Event()
_sleep = time.sleep


def call() -> None:
    inside.set()
    try:
        store.add("beat", 1)  # blocks: its host is stopped
    except RuntimeError:
        pass


class Teardown:
    """Runs in the interpreter's last collection, after it marked itself finalizing."""

    def __del__(self) -> None:
        host.kill()  # the blocked call returns now (connection reset)
        _sleep(2)


def _request_queued_at_host() -> bool:
    """The call's request sits unread in the stopped host's socket: the thread is inside the C++ call."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                local_port = int(cols[1].rsplit(":", 1)[1], 16)
                state, rx_queue = cols[3], int(cols[4].split(":")[1], 16)
                if local_port == port and state == "01" and rx_queue > 0:  # 01: established
                    return True
    return False


threading.Thread(target=call, daemon=True).start()
assert inside.wait(10)
deadline = time.monotonic() + 30
while not _request_queued_at_host():
    assert time.monotonic() < deadline, "the store call never reached the host"
    _sleep(0.01)
t = Teardown()
t.cycle = t
del t
if sys.argv[1] == "end":
    end_process(94)
sys.exit(94)
