"""The agent's state table and its decision function, in-process: no store, no worker, no process."""

from __future__ import annotations

import signal

import pytest

from resilient_train.base import exitcodes
from resilient_train.agent import AgentState
from resilient_train.agent import events as ev
from resilient_train.agent.decide import View, decide
from resilient_train.agent.state import AgentError, AgentLifecycle, allowed_moves
from resilient_train.base.transitions import IllegalTransition
from resilient_train.agent.restarts import WorkerFailure, RestartPolicy

S = AgentState
MOVES = {
    S.STARTING: {S.WAITING_FOR_NODE, S.RUNNING, S.FENCED, S.FAILED},
    S.WAITING_FOR_NODE: {S.STARTING, S.DONE, S.FAILED},
    S.RUNNING: {S.RESTARTING, S.STOPPING, S.SHUTTING_DOWN, S.LEAVING, S.FENCED, S.DONE, S.FAILED},
    S.RESTARTING: {S.RUNNING, S.FAILED},
    S.STOPPING: {S.LEAVING, S.DONE, S.FAILED},
    S.SHUTTING_DOWN: {S.LEAVING, S.DONE, S.FAILED},
    S.LEAVING: {S.DONE, S.FAILED},
    S.FENCED: {S.DONE, S.FAILED},
    S.DONE: set(),
    S.FAILED: set(),
}


def _at(state: AgentState) -> AgentLifecycle:
    """A lifecycle brought to ``state`` through allowed moves only."""
    path = {S.STARTING: [], S.WAITING_FOR_NODE: [S.WAITING_FOR_NODE], S.RUNNING: [S.RUNNING],
            S.RESTARTING: [S.RUNNING, S.RESTARTING], S.STOPPING: [S.RUNNING, S.STOPPING],
            S.SHUTTING_DOWN: [S.RUNNING, S.SHUTTING_DOWN], S.LEAVING: [S.RUNNING, S.LEAVING],
            S.FENCED: [S.RUNNING, S.FENCED],
            S.DONE: [S.RUNNING, S.DONE], S.FAILED: [S.FAILED]}[state]
    lc = AgentLifecycle()
    for s in path:
        lc.to(s)
    assert lc.state is state
    return lc


@pytest.mark.timeout(30)
def test_every_allowed_move_is_allowed_and_every_other_raises() -> None:
    assert {k: set(v) for k, v in allowed_moves().items()} == MOVES
    for a in S:
        for b in S:
            lc = _at(a)
            if b in MOVES[a]:
                lc.to(b)
                assert lc.state is b and lc.history[-1] is b
            else:
                with pytest.raises(IllegalTransition, match=f"{a.value} -> {b.value}"):
                    lc.to(b)
                assert lc.state is a  # an illegal move changes nothing


@pytest.mark.timeout(30)
def test_end_and_fail_carry_the_exit_code() -> None:
    lc = _at(S.RUNNING)
    assert lc.end(75, "preempted") == 75 and (lc.state, lc.exit_code, lc.reason) == (S.DONE, 75, "preempted")
    lc = _at(S.SHUTTING_DOWN)
    lc.fail(AgentError("store lost", exit_code=1))
    assert (lc.state, lc.exit_code) == (S.FAILED, 1)
    with pytest.raises(IllegalTransition):
        _at(S.STARTING).end(0)  # nothing started: the agent cannot have finished


def _failure(rank: int, kind: str = "exception", summary: str | None = "RuntimeError: boom", how: str = "exit code 1",
             at: float = 0.0) -> WorkerFailure:
    return WorkerFailure(rank=rank, how=how, kind=kind, summary=summary, at=at)


def _view(**kw: object) -> View:
    base = dict(state=S.RUNNING, pids={0: 100, 1: 101}, max_replacements=2, max_restarts=1,
                restart_policy=RestartPolicy(1))
    base.update(kw)
    return View(**base)  # type: ignore[arg-type]


def _exit(rank: int = 1, rc: int = 1, **kw: object) -> ev.WorkerExited:
    base = dict(rank=rank, pid=100 + rank, rc=rc, failure=_failure(rank) if rc != 0 else None)
    base.update(kw)
    return ev.WorkerExited(**base)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_a_worker_exit_is_decided_by_its_code_and_what_the_store_said() -> None:
    v = _view()
    assert decide(v, _exit(rc=0)) == ev.MarkSucceeded(rank=1)
    assert isinstance(decide(v, _exit(pid=999)), ev.Ignore)  # a worker replaced meanwhile (a restart of all)
    stop = decide(v, _exit(rc=1, stop={"rank": 0, "summary": "a bug", "exit_code": 28}))
    assert stop == ev.StopJob(rank=1, rc=1, exit_code=28, reason="rank 0 stopped it: a bug")
    assert decide(v, _exit(rc=exitcodes.STOPPED)).exit_code == exitcodes.STOPPED  # type: ignore[union-attr]
    assert decide(v, _exit(rc=exitcodes.REQUEUE)) == ev.ShutDown(signum=None, signalled=False, preempted_rank=1)
    assert decide(v, _exit(rc=exitcodes.VALIDATION_FAILED)) == ev.StopJob(
        rank=1, rc=17, exit_code=17, reason="the rerun policy stopped the job")
    late = decide(v, _exit(final=True, supervised=True))
    assert isinstance(late, ev.MarkSucceeded) and late.after_final is not None  # the run is over already


@pytest.mark.timeout(30)
def test_a_supervised_rank_is_replaced_within_its_budget() -> None:
    died = _exit(supervised=True)
    assert decide(_view(replacements=1), died) == ev.Replace(failure=died.failure)  # type: ignore[arg-type]
    spent = decide(_view(replacements=2), died)
    assert isinstance(spent, ev.Fail) and "--max-replacements" in spent.message and spent.exit_code == 1


@pytest.mark.timeout(30)
def test_a_plain_script_is_restarted_torchruns_way_with_blame_and_the_repeat_rule() -> None:
    first, follower = _failure(1, at=1.0), _failure(0, kind="signal", summary=None, how="signal SIGABRT", at=2.0)
    died = _exit(rank=1, failure=first, followed=(follower,))
    d = decide(_view(), died)
    assert isinstance(d, ev.RestartAll)
    assert d.blame == "rank 1 failed first (exit code 1): RuntimeError: boom; rank 0 (signal SIGABRT) followed"
    # The same exception again with no progress in between: a bug, exit 93.
    policy = RestartPolicy(5)
    policy.decide(first, reported_step=3)
    again = decide(_view(restart_policy=policy, reported_step=3, attempt=1), died)
    assert isinstance(again, ev.Fail) and again.exit_code == exitcodes.STOPPED and again.restart_decision == "repeated"
    assert policy.restarts == 1  # asked, not changed: only the action counts a restart
    budget = decide(_view(restart_policy=RestartPolicy(0), max_restarts=0), died)
    assert isinstance(budget, ev.Fail) and "no restarts allowed" in budget.message and budget.exit_code == 1
    across = decide(_view(nnodes=2), died)
    assert isinstance(across, ev.Fail) and "across nodes is not supported" in across.message
    hung = decide(_view(), _exit(rank=1, failure=_failure(1, kind="hang", summary="hung in forward"),
                                 followed=(_failure(0, kind="hang", summary="hung in backward"),)))
    assert isinstance(hung, ev.RestartAll) and hung.blame == "ranks 0, 1 hung (hung in forward)"


@pytest.mark.timeout(30)
def test_hangs_signals_nodes_spares_and_the_end() -> None:
    v = _view(killing=frozenset({0}))
    hang = {"kind": "hang", "phase": "forward", "step": 3, "since_progress_s": 9.0, "timeout_s": 5.0}
    assert decide(v, ev.RankHung(rank=1, pid=101, cause=hang)) == ev.Kill(rank=1, pid=101, cause=hang,
                                                                         dump_stacks=True)
    assert decide(v, ev.RankHung(rank=1, pid=101, cause={"kind": "straggler"})).dump_stacks is False  # type: ignore[union-attr]
    assert isinstance(decide(v, ev.RankHung(rank=0, pid=100, cause=hang)), ev.Ignore)  # already being killed
    assert isinstance(decide(v, ev.RankHung(rank=1, pid=5, cause=hang)), ev.Ignore)  # another process now
    assert decide(v, ev.StacksDue(rank=1, pid=101)) == ev.KillDumped(rank=1)
    assert decide(v, ev.NodeLost(node=2, incarnation=1)) == ev.ClaimNode(node=2, incarnation=1)
    assert decide(v, ev.Signalled(signum=signal.SIGTERM)) == ev.ShutDown(signum=signal.SIGTERM, signalled=True)
    waiting = decide(_view(state=S.WAITING_FOR_NODE), ev.Signalled(signum=signal.SIGTERM))
    assert isinstance(waiting, ev.End) and waiting.exit_code == 128 + signal.SIGTERM  # a spare that took no node
    assert decide(v, ev.PeerStopping(signum=signal.SIGUSR1, node=1)) == ev.ShutDown(signum=signal.SIGUSR1,
                                                                                    signalled=False)
    assert decide(v, ev.AllSucceeded()) == ev.Leave(exit_code=0)
    assert decide(v, ev.SupervisedSeen()) == ev.EnableSpares()
    assert decide(v, ev.SpareDue()) == ev.StartSpare()
    assert decide(v, ev.NodeAssigned(node=1)) == ev.TakeNode(node=1)
    assert decide(v, ev.JobEnded(preempted=False)).exit_code == 0  # type: ignore[union-attr]
    assert decide(v, ev.JobEnded(preempted=True)).exit_code == exitcodes.REQUEUE  # type: ignore[union-attr]
    assert decide(v, ev.MonitorStateDue()) == ev.SaveMonitorState()
    assert decide(v, ev.MonitorStateOffered()) == ev.TakeOffer()


@pytest.mark.timeout(30)
def test_a_lost_store_fences_every_node_but_its_host_unless_its_part_had_finished() -> None:
    """A node that lost the store cannot tell node 0's loss from its own link's, nor know whether the job
    declared it lost: it is fenced (94), in one line; node 0, whose agent hosts the store, fails (1)."""
    v = _view(hosting=False, store_address="10.0.0.1:29500")
    lost = decide(v, ev.StoreUnreachable(error="the store did not answer a check within 5 s"))
    assert isinstance(lost, ev.FenceNode) and lost.how == "lost the store on 10.0.0.1:29500"
    assert lost.line is not None and lost.line.startswith(
        "lost the store on 10.0.0.1:29500 (node 0's agent is gone or does not answer, or this node is cut off from "
        "it: the store did not answer a check within 5 s): this node cannot know whether it was declared lost")
    assert "(exit code 94)" in lost.line and "\n" not in lost.line
    assert decide(_view(hosting=False, state=S.STARTING), ev.StoreUnreachable(error="reset")).line is not None  # type: ignore[union-attr]
    spare = decide(_view(hosting=False, state=S.WAITING_FOR_NODE), ev.StoreUnreachable(error="reset"))
    assert isinstance(spare, ev.End) and (spare.exit_code, spare.reason) == (exitcodes.FENCED, "fenced")
    leaving = decide(_view(hosting=False, state=S.LEAVING), ev.StoreUnreachable(error="reset"))
    assert isinstance(leaving, ev.Fail) and leaving.exit_code == exitcodes.FENCED  # nothing left to kill first
    fenced = decide(v, ev.StoreUnreachable(error="Connection reset by peer", fenced=True))
    assert isinstance(fenced, ev.FenceNode) and fenced.how == "its ranks left fenced; the store is gone since"
    for hosting in (False, True):
        done = decide(_view(hosting=hosting), ev.StoreUnreachable(error="Connection reset by peer", finished=True))
        assert isinstance(done, ev.End) and done.exit_code == 0
    own = decide(_view(hosting=True, store_address="10.0.0.1:29500"), ev.StoreUnreachable(error="Connection reset"))
    assert isinstance(own, ev.Fail) and own.exit_code == exitcodes.FAILED
    assert "lost the store on 10.0.0.1:29500 (this agent's own store failed)" in own.message


@pytest.mark.timeout(30)
def test_a_node_declared_lost_while_its_agent_lived_is_fenced_unless_it_had_finished() -> None:
    v = _view()
    assert isinstance(decide(v, ev.Fenced(how="no beat for 2 s")), ev.FenceNode)
    assert decide(_view(finished=True), ev.Fenced(how="no beat for 2 s")) == ev.Leave(exit_code=0)
    assert isinstance(decide(v, _exit(rc=exitcodes.FENCED)), ev.FenceNode)  # a rank saw the fence first


def test_every_kind_of_event_has_one_rule_and_every_kind_of_decision_one_action() -> None:
    """The two tables the agent runs on (resilient_train.agent.decide.RULES, resilient_train.agent.act.ACTIONS):
    each kind is dispatched by its type, so a kind added without a rule or an action fails here, not at the
    moment an agent meets it."""
    from typing import get_args

    from resilient_train.agent.act import ACTIONS
    from resilient_train.agent.decide import RULES

    assert set(RULES) == set(get_args(ev.Event))
    assert set(ACTIONS) == set(get_args(ev.Decision))
    view = View(state=AgentState.RUNNING)
    for event in (ev.StacksDue(rank=1, pid=4242), ev.SupervisedSeen(), ev.SpareDue(), ev.MonitorStateDue(),
                  ev.MonitorStateOffered(), ev.NodeAssigned(node=2)):
        assert type(decide(view, event)) in ACTIONS  # what a rule decides, an action carries out
