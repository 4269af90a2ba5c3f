"""The coordination protocol at N = 64 simulated ranks, through bench/coordination.py's own code path.

Real store server and client processes, the runtime's own protocol functions;
the assertions are on outcomes (every rank agreed on one plan, the right ranks
heal), never on timings.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from resilient_train.store import Keys

_PATH = Path(__file__).resolve().parents[2] / "bench" / "coordination.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_coordination", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(240)
def test_64_ranks_agree_through_two_generation_changes() -> None:
    bench = _bench()
    out = bench.run_size(bench.BenchConfig(world_size=64, procs=2, steady_steps=2, step_s=0.2, timeout_s=60.0))
    # run_size raises unless all 64 ranks reported one and the same plan in every phase
    assert out["start"]["plan"][:3] == [0, "start", None]
    one, pct = out["one_lost"]["plan"], out["pct_lost"]["plan"]
    lost_a, lost_b = bench._Bench.lost_sets(64)
    assert one[:2] == [1, "live"] and one[2] == 2  # the boundary every survivor holds
    assert sorted(t for t, _ in one[3]) == lost_a and one[5] == lost_a  # only the replacement heals
    assert all(f not in lost_a for _, f in one[3])
    assert pct[:3] == [2, "live", 3] and sorted(t for t, _ in pct[3]) == lost_b and pct[5] == lost_b
    assert out["one_lost"]["ops_per_rank"] < 64  # O(1) requests per rank, not O(N)


@pytest.mark.timeout(60)
def test_a_failed_generation_settles_its_join_for_everyone() -> None:
    import torch.distributed as dist

    from resilient_train.store import current_generation, report_fault

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert current_generation(store) == 0
    first, cause = report_fault(store, 0, {"rank": 3, "kind": "exit"}, world_size=4)
    again, same = report_fault(store, 0, {"rank": 1, "kind": "late"}, world_size=4)
    assert first and not again and cause == same == {"rank": 3, "kind": "exit"}
    assert current_generation(store) == 1
    assert store.get(Keys.settled(0)).decode() == Keys.FAILED
    assert store.check([Keys.wake(0, r) for r in range(4)])
