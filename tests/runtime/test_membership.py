"""An agent's view of the other nodes (resilient_train.agent.membership) against a real store, without processes."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from jobs import GPT
from monitors import EventLog
from resilient_train.agent.config import AgentConfig
from resilient_train.agent.membership import Membership, fence_wait_s
from resilient_train.protocol.succession.location import call_timeout_s
from resilient_train.agent.succession import AgentSuccession
from resilient_train.protocol.nodes import NodeKeys, register_node
from resilient_train.protocol.succession.location import Endpoint
from resilient_train.protocol.succession.rules import SuccessionKeys
from resilient_train.protocol.succession.rules import register


@pytest.mark.timeout(60)
def test_a_node_that_finished_and_left_is_not_declared_lost_when_its_beat_stops(tmp_path: Path) -> None:
    """Node 0's agent may outlive the others' by seconds (its rank releasing a group whose peer was cut off):
    a node that said it is done is silent by then, and that is its end, not a loss."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    config = AgentConfig(script=str(GPT), run_dir=str(tmp_path), nnodes=4, node_rank=0, node_timeout_s=0.3,
                         master_port=store.port)
    succession = AgentSuccession(master_addr="127.0.0.1", token="t", node_timeout_s=0.3, hosting=True,
                                 wrap=lambda raw: raw, source="test")
    m = Membership(config, events=EventLog(None, source="agent0"), say=lambda line: None, succession=succession,
                   endpoint=lambda: Endpoint("127.0.0.1", store.port))
    m.register(store, lambda: dist.TCPStore("127.0.0.1", store.port, is_master=False,
                                            timeout=timedelta(seconds=10)))
    try:
        for node in (1, 2, 3):  # registered with one beat each, then silence; node 3 goes on beating
            register(store, {"addr": "127.0.0.1", "port": 1, "node": node, "incarnation": register_node(store, node)})
        store.set(NodeKeys.done(1), "1")  # node 1 finished and left; node 2 just went silent
        lost: list[int] = []
        deadline = time.monotonic() + 30
        while 2 not in lost:  # the host's census looks once a second
            assert time.monotonic() < deadline, lost
            store.add(SuccessionKeys.beat(3), 1)  # node 3 lives: with node 0, a majority of the four
            lost += [e.node for e in m.poll(store, hosting=True)]  # type: ignore[union-attr]
            time.sleep(0.05)
        assert lost == [2]
    finally:
        m.close()


@pytest.mark.timeout(30)
def test_the_agent_taking_a_node_over_waits_until_a_node_only_cut_off_has_fenced_itself() -> None:
    """A cut node's agent gives up on the store call_timeout_s after its first unanswered call; the job declares
    it lost node_timeout after its last beat; so the replacements wait the difference more, below 5 s."""
    for node_timeout in (0.5, 1.0, 2.0, 4.0, 5.0, 10.0, 60.0):
        # From the cut node's last beat: its replacement starts at node_timeout + the wait at the earliest, and it
        # has killed its ranks by call_timeout_s (plus its loop's step); min(5 s, node_timeout) is left between.
        assert node_timeout + fence_wait_s(node_timeout) >= call_timeout_s(node_timeout) + min(5.0, node_timeout)
    assert (fence_wait_s(60.0), fence_wait_s(10.0), fence_wait_s(2.0), fence_wait_s(1.0)) == (5.0, 5.0, 5.0, 5.0)
