"""The shutdown policy's parts on their own: the values it accepts, the verdict from the ranks' records, the folding
of c10d's C++ dumps. (The jobs that prove it end to end are in test_preemption.py and test_nodes.py.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch.distributed as dist

from jobs import GPT, REPO, cli
from resilient_train.base import exitcodes
from resilient_train.rank.preempt import PreemptionConfig
from resilient_train.protocol.shutdown import DEFAULT_GRACE_S, Shutdown, auto_grace, publish_grace, record_preempted

BAD = ["inf", "-inf", "nan", "-1", "1e308"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("value", ["inf", "nan"])
def test_a_bad_shutdown_timeout_is_one_line_and_exit_2(tmp_path, value):
    p = cli("run", "--shutdown-timeout", value, "--run-dir", str(tmp_path / "run"), str(GPT))
    assert p.returncode == 2, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--shutdown-timeout" in lines[0] and value in lines[0], p.stderr


@pytest.mark.timeout(60)
def test_grace_and_shutdown_timeout_must_be_finite_seconds_in_range(tmp_path):
    from resilient_train.agent import AgentConfig

    for value in BAD:
        with pytest.raises(ValueError, match="--shutdown-timeout must be a finite number of seconds") as e:
            AgentConfig(script=str(GPT), shutdown_timeout_s=float(value))
        assert "\n" not in str(e.value)
    assert AgentConfig(script=str(GPT), shutdown_timeout_s=0.0).shutdown_timeout_s == 0.0  # torchrun's: kill at once
    for value in [*map(float, BAD), 0.0, 2.0, True]:
        with pytest.raises(ValueError, match="preemption.grace_s must be") as e:
            PreemptionConfig(grace_s=value)
        assert "\n" not in str(e.value)
    assert PreemptionConfig(grace_s=8).grace_s == 8


@pytest.mark.timeout(60)
def test_sigusr2_cannot_be_a_preemption_signal_it_asks_a_hung_rank_for_its_stacks():
    with pytest.raises(ValueError, match="SIGUSR2 cannot preempt: the agent asks a hung rank for its stacks") as e:
        PreemptionConfig(signals=("SIGTERM", "SIGUSR2"))
    assert "\n" not in str(e.value)
    assert PreemptionConfig(signals=("SIGUSR1",)).signals == ("SIGUSR1",)


@pytest.mark.timeout(60)
def test_the_default_grace_covers_two_of_the_longest_save_and_the_exit():
    assert auto_grace(0.0) == DEFAULT_GRACE_S
    assert auto_grace(40.0) == 2 * 1.5 * 40.0 + 2.0  # a save in flight and the preemption's, half again for slack


def _shutdown(ranks=(0, 1), nnodes=1, node=0, timeout_s=30.0, given=False) -> Shutdown:
    return Shutdown(node=node, nnodes=nnodes, ranks=ranks, timeout_s=timeout_s, timeout_given=given)


@pytest.mark.timeout(60)
def test_the_verdict_comes_from_what_the_ranks_recorded():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    plain = _shutdown(ranks=(4, 5))  # no rank published a grace: a script without the Supervisor
    plain.begin(store, signal.SIGTERM, signalled=True)
    assert plain.grace_s is None and plain.deadline == pytest.approx(plain.began_at + 30.0)
    assert "forwarding it to the workers (SIGKILL after 30 s)" in plain.received_line()
    v = plain.verdict(store, {4: -15, 5: -15})
    assert (v.exit_code, v.line) == (128 + signal.SIGTERM, None)

    for rank in (0, 1):
        publish_grace(store, rank, 12.0)
    sd = _shutdown(given=True, timeout_s=3.0)
    sd.begin(store, signal.SIGTERM, signalled=True)
    assert sd.grace_s == 12.0 and sd.deadline == pytest.approx(sd.began_at + 12.0)
    assert "SIGKILL after 12 s, their preemption grace; --shutdown-timeout is for scripts" in sd.received_line()
    # No rank reached a boundary before they were killed.
    v = sd.verdict(store, {0: -9, 1: -9})
    assert v.exit_code == 128 + signal.SIGTERM and "before any rank reached a step boundary" in v.line
    # Both killed in their teardown, after the commit that rank 0 recorded: 75.
    record_preempted(store, 0, step=7, committed=True)
    record_preempted(store, 1, step=7, committed=None)
    v = sd.verdict(store, {0: -9, 1: -9})
    assert (v.exit_code, v.step, v.committed) == (exitcodes.REQUEUE, 7, True)
    assert v.line == ("preempted (SIGTERM): every rank stopped at step 7; its checkpoint is committed; start the job "
                      "again to resume (exit code 75)")
    # Stopped at a boundary, but the checkpoint did not commit within the grace: 75 all the same, said so.
    record_preempted(store, 0, step=7, committed=False)
    v = sd.verdict(store, {0: 75, 1: -9})
    assert v.exit_code == exitcodes.REQUEUE and not v.committed and "did not commit within the grace (12 s)" in v.line
    # The signal came after the last step: the job is done.
    assert sd.verdict(store, {0: 0, 1: 0}).exit_code == 0
    # A rank stopped the job meanwhile (its preemption's save found the disk full): its code, not a requeue.
    from resilient_train.protocol.store import request_stop

    request_stop(store, {"rank": 1, "summary": "the disk is full", "exit_code": exitcodes.DISK_FULL})
    v = sd.verdict(store, {0: 28, 1: 28})
    assert v.exit_code == exitcodes.DISK_FULL and "rank 1 stopped it: the disk is full" in v.line


@pytest.mark.timeout(60)
def test_a_signalled_agent_tells_the_other_nodes():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    node1, node0 = _shutdown(ranks=(2, 3), nnodes=2, node=1), _shutdown(ranks=(0, 1), nnodes=2, node=0)
    assert node0.stopping(store) is None
    node1.begin(store, signal.SIGUSR1, signalled=True)
    node0._stopping_at = 0.0  # looked at about once a second: look now
    assert node0.stopping(store) == signal.SIGUSR1 and node0.from_node == 1
    node0.begin(store, signal.SIGUSR1, signalled=False)
    record_preempted(store, 0, step=3, committed=True)
    assert node0.verdict(store, {0: 75, 1: 75}).line.startswith("preempted (SIGUSR1 to node 1): every rank stopped")


_HOST = "import sys, time, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, is_master=True, " \
        "wait_for_workers=False); print(s.port, flush=True); time.sleep(60)"


@pytest.mark.timeout(60)
def test_a_lost_store_keeps_what_was_read_and_trusts_the_ranks_exit_codes():
    host = subprocess.Popen([sys.executable, "-c", _HOST], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        publish_grace(store, 0, 20.0)
        sd = _shutdown(ranks=(0, 1))
        sd.begin(store, signal.SIGTERM, signalled=True)
        assert sd.grace_s == 20.0
    finally:
        host.kill()
        host.wait()
    v = sd.verdict(store, {0: 75, 1: 75})
    assert sd.store_lost and v.exit_code == exitcodes.REQUEUE and sd.grace_s == 20.0


_DUMP = b"""[rank3]:[W1202 06:30:13.508153940 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed on SocketImpl(fd=5): Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?
Exception raised from recvBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp:787 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >) + 0x9d (0x7fdf25579b8d in /x/torch/lib/libc10.so)
frame #3: <unknown function> + 0x674888d (0x7fdf1714888d in /x/torch/lib/libtorch_cpu.so)
<omitting python frames>
frame #22: <unknown function> + 0x1098ec (0x7fdf279278ec in /lib/x86_64-linux-gnu/libc.so.6)

[rank3]:[W1202 06:30:13.515054344 TCPStore.cpp:106] [c10d] sendBytes failed on SocketImpl(fd=4): Broken pipe
Exception raised from sendBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp:758 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >) + 0x9d (0x7fdf25579b8d in /x/torch/lib/libc10.so)
frame #19: _start + 0x21 (0x55d5ee6f0081 in /x/bin/python)

[W1202 06:31:42.386095181 ProcessGroupGloo.cpp:125] Warning: something about gloo
frame #1: a line of the user's, not a C++ frame
"""


@pytest.mark.timeout(60)
def test_a_ranks_c10d_dumps_fold_to_one_line():
    from resilient_train.agent.nativelog import NativeLogFolder

    folder = NativeLogFolder()
    shown = []
    for line in _DUMP.splitlines(keepends=True):
        out = folder.feed(line)
        shown += [line] if out is None else out
    assert shown == [b"[W1202 06:31:42.386095181 ProcessGroupGloo.cpp:125] Warning: something about gloo\n",
                     b"frame #1: a line of the user's, not a C++ frame\n"]


_LOSE_STORE = textwrap.dedent("""
    import subprocess, sys
    from datetime import timedelta
    import torch.distributed as dist
    from resilient_train.agent.nativelog import FoldedStderr

    host = subprocess.Popen([sys.executable, "-c", sys.argv[2]], stdout=subprocess.PIPE, text=True)
    port = int(host.stdout.readline())
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    store.set("a", "1")
    host.kill(); host.wait()

    def lose():
        for _ in range(2):
            try:
                store.set("b", "2")
            except dist.DistError:
                pass
        print("store lost: the one line", file=sys.stderr, flush=True)

    if sys.argv[1] == "folded":
        with FoldedStderr():
            lose()
    else:
        lose()
""")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["folded", "raw"])
def test_the_agents_own_store_connections_dump_nothing_on_its_console(mode):
    p = subprocess.run([sys.executable, "-c", _LOSE_STORE, mode, _HOST], cwd=REPO, capture_output=True, timeout=60)
    err = p.stderr.decode(errors="replace")
    assert p.returncode == 0 and "store lost: the one line" in err, err
    if mode == "raw":  # c10d prints its C++ stack on its own, here: what the agent's console is spared
        assert "frame #" in err and "[c10d]" in err, err
    else:
        assert [line for line in err.splitlines() if line.strip()] == ["store lost: the one line"], err
