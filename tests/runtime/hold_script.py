"""A worker that holds its job open: prints "ready", then waits for a line on stdin (the test's signal)."""

import sys

print("ready", flush=True)
sys.stdin.readline()
