"""Healing's order and ``restore_live`` (resilient_train/rank/heal.py), in process.

What the design promises (docs/design.md, "Healing", "The plan"): every rank
runs the plan's transfers in one order, by target, so a rank that both serves
and receives never waits on a peer that waits on it; a restore enters the heal
phase first, loads the replicated state (its own host copy, or what a source
sends), then the local state of the plan's step that the rank published, then
lets a replacement's rerun machine adopt its record, and only then stands at
the boundary (``live``). The transfers of many ranks are checked by playing
every rank's sequence against the others with blocking point-to-point
semantics; the restore runs on a real stepper, store and gloo group of one.
"""

from __future__ import annotations

import random

import pytest
import torch
from heart_rig import Rig

from monitors.events import read_events
from resilient_train.rank.generation import ResumePlan, ResumeSource
from resilient_train.rank.heal import heal_order, restore_live
from resilient_train.rank.local_state import decode_local
from resilient_train.rank.snapshot import HostSnapshot

pytestmark = pytest.mark.timeout(60)

Ops = dict[int, list[tuple[str, int]]]  # rank -> its point-to-point operations, in order: ("send"|"recv", peer)


def _ops(transfers: list[tuple[int, int, bool]]) -> Ops:
    """What each rank does, in its order, given the transfers in the order every rank runs them."""
    ops: Ops = {}
    for target, source, _ in transfers:
        ops.setdefault(source, []).append(("send", target))
        ops.setdefault(target, []).append(("recv", source))
    return ops


def _completes(ops: Ops) -> bool:
    """Plays blocking sends and receives: an operation completes when its peer stands at the matching one."""
    at = {r: 0 for r in ops}
    while True:
        moved = False
        for r, mine in ops.items():
            if at[r] == len(mine):
                continue
            kind, peer = mine[at[r]]
            theirs = ops[peer][at[peer]] if at[peer] < len(ops[peer]) else None
            if theirs == ("recv" if kind == "send" else "send", r):
                at[r] += 1
                at[peer] += 1
                moved = True
        if all(at[r] == len(m) for r, m in ops.items()):
            return True
        if not moved:
            return False


def test_the_player_finds_a_deadlock() -> None:
    # Rank 0 serves 1 and receives from 2; rank 2 serves 0 and receives from 1: sends first on every rank waits.
    assert not _completes({0: [("send", 1), ("recv", 2)], 1: [("send", 2), ("recv", 0)],
                           2: [("send", 0), ("recv", 1)]})


def test_every_plan_heals_without_a_rank_waiting_on_one_that_waits_on_it() -> None:
    rng = random.Random(7)
    for _ in range(300):
        world = rng.randint(2, 12)
        ranks = list(range(world))
        targets = rng.sample(ranks, rng.randint(1, world - 1))
        heal_from, buddy_from = {}, {}
        for t in targets:  # a source may itself be a target (a buddy holder that lost its own state serves)
            (buddy_from if rng.random() < 0.4 else heal_from)[t] = rng.choice([r for r in ranks if r != t])
        plan = ResumePlan(generation=1, source=ResumeSource.LIVE, step=5, heal_from=heal_from,
                          buddy_from=buddy_from)
        order = heal_order(plan)
        assert [t for t, _, _ in order] == sorted(targets)
        assert {(t, s) for t, s, b in order if b} == set(buddy_from.items())
        assert _completes(_ops(order)), order


def _train_to(rig: Rig, steps: int) -> None:
    while rig.state.step < steps:
        rig.step(rig.train)


def test_a_rank_restores_its_own_host_copy_then_its_local_state(rig: Rig) -> None:
    _train_to(rig, 1)
    snapshot = HostSnapshot()
    snapshot.capture(1, rig.state.replicated_state_dict(), rig.slots.read(0, 1))  # type: ignore[arg-type]
    at_one = rig.params()
    _train_to(rig, 2)  # then torn: its live state moved past the boundary the plan picks
    assert not all(torch.equal(a, b) for a, b in zip(at_one, rig.params()))
    order: list[str] = []
    rig.trace.seen.clear()
    plan = ResumePlan(generation=1, source=ResumeSource.LIVE, step=1, from_snapshot=[0])

    def adopt() -> None:  # a replacement's rerun machine: after the local state is loaded
        order.append(f"adopt at step {rig.state.step}")

    restore_live(plan, state=rig.state, rank=0, stepper=rig.stepper, slots=rig.slots, device=torch.device("cpu"),
                 events=rig.events, snapshot=snapshot, buddy=None, adopt_record=adopt)
    assert rig.trace.seen[0][0] == "heal"  # the heal phase is entered before anything loads
    assert all(torch.equal(a, b) for a, b in zip(at_one, rig.params()))
    assert rig.state.step == 1 and order == ["adopt at step 1"]
    assert torch.equal(torch.get_rng_state(), decode_local(rig.slots.read(0, 1))["rng"]["torch"])  # type: ignore[arg-type]
    assert rig.stepper.live == 1 and rig.stepper.published[0] == 1  # type: ignore[index]
    healed = [e for e in read_events(rig.events_path) if e["event"] == "healed"]
    assert [(e["step"], e["from_own_copy"], e["bytes_sent"], e["bytes_received"]) for e in healed] == \
        [(1, True, 0, 0)]
    _train_to(rig, 2)  # and trains on from there
    assert rig.stepper.live == 2


def test_a_survivor_at_the_plans_step_only_reloads_its_local_state(rig: Rig) -> None:
    _train_to(rig, 1)
    at_one = rig.params()
    torch.rand(5)  # the failed step drew from the RNG before it failed
    plan = ResumePlan(generation=1, source=ResumeSource.LIVE, step=1)
    restore_live(plan, state=rig.state, rank=0, stepper=rig.stepper, slots=rig.slots, device=torch.device("cpu"),
                 events=rig.events, snapshot=None, buddy=None, adopt_record=None)
    assert all(torch.equal(a, b) for a, b in zip(at_one, rig.params()))
    assert torch.equal(torch.get_rng_state(), decode_local(rig.slots.read(0, 1))["rng"]["torch"])  # type: ignore[arg-type]
    assert rig.stepper.live == 1
    assert not [e for e in read_events(rig.events_path) if e["event"] == "healed"]  # nothing moved: no event
