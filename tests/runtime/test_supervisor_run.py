"""One run of a Supervisor is an object of its own (resilient_train.rank.running.Run): nothing of it exists before
``run``, the script reads the current one from inside its step, and ``add_part`` is refused once it began.

A real Supervisor alone (no launcher: a store on loopback, a gloo group of one), in a process of its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from jobs import REPO

SCRIPT = textwrap.dedent("""
    import torch
    import resilient_train as rt
    from resilient_train.rank.lifecycle import SupervisorState
    from resilient_train.rank.parts import Part

    sup = rt.Supervisor(rt.SupervisorConfig(steps=3, write_final=False))
    print("before:", sup.current is None, sup.generation, sup.mesh, sup.buddy, sup.snapshot)
    model = torch.nn.Linear(4, 2)
    seen = []

    def step(ctx):
        seen.append((sup.generation, sup.current.lifecycle.state.value, ctx.step))
        loss = model(torch.ones(1, 4)).sum()
        loss.backward()
        ctx.average_gradients()
        return loss.detach()

    state = rt.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    sup.run(step, state)
    print("inside:", seen)
    print("after:", state.step, sup.current.lifecycle.state.value, sup.generation)
    try:
        sup.add_part(Part())
    except rt.UsageError as e:
        print("refused:", e)
""")


@pytest.mark.timeout(120)
def test_a_run_exists_from_runs_first_line_and_the_script_reads_it_from_inside():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert lines["before"] == "True -1 None None None"
    assert lines["inside"] == "[(0, 'training', 0), (0, 'training', 1), (0, 'training', 2)]"
    assert lines["after"] == "3 done 0"
    assert lines["refused"] == "add_part must be called before run()"
