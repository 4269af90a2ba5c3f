"""examples/train_gpt.py (a resilient_train Supervisor job) whose ranks never finish exiting after a preemption.

A teardown that hangs after the checkpoint (a user's atexit hook, a thread that
does not stop) and ignores SIGTERM: the agent must SIGKILL the rank at the end
of the grace, and still exit 75, because the checkpoint committed.
"""

import runpy
import signal
import sys
import time
from pathlib import Path

GPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"

sys.argv = [str(GPT), *sys.argv[1:]]
try:
    runpy.run_path(str(GPT), run_name="__main__")
except SystemExit as e:
    if e.code == 75:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("hang_after_preempt: preempted, now hanging in teardown", file=sys.stderr, flush=True)
        time.sleep(600)
    raise
