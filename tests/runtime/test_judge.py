"""The judge (resilient_train/rank/judge.py), in process: which failures are recovered, which stop the job, and how.

What the design promises (docs/design.md, "A healthy job is never killed"; the
module's docstring): a collective or store error is a fault however often it
comes; the same exception (type, message without its numbers, place) raised
again by the same rank, on the replay or at any later step, stops the job with
93 after one retry; a misuse, a full disk, an unwritable store of the run, a
world that never assembles stop at once; the recovery budgets stop a job that
makes no progress. The exceptions here are real ones, raised, with their
tracebacks: their place is part of what makes two of them the same.
"""

from __future__ import annotations

import errno

import pytest

from checkpointing.errors import UnwritableError
from resilient_train.base import exitcodes
from resilient_train.rank.errors import Failure, FailureKind, GenerationFailed, UsageError, WrongInput
from resilient_train.rank.generation import JoinError
from resilient_train.rank.judge import Judge, Stop

pytestmark = pytest.mark.timeout(30)


def _here(exc: BaseException) -> BaseException:
    """``exc`` as a step raises it (with a traceback whose innermost frame is this line)."""
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001
        return e


def _elsewhere(exc: BaseException) -> BaseException:
    """``exc`` raised at another place."""
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001
        return e


def _judge(**kw: int) -> Judge:
    return Judge(max_recoveries=kw.get("max_recoveries", 100), max_failed_generations=kw.get("max_failed", 8))


def test_an_exception_replayed_is_a_bug_with_the_first_traceback() -> None:
    judge = _judge()
    first = judge.failure(_here(IndexError("index 7 is out of range")), step=5, generation_moved=False)
    assert isinstance(first, Failure) and first.kind is FailureKind.EXCEPTION
    again = judge.failure(_here(IndexError("index 8 is out of range")), step=5, generation_moved=False)
    assert isinstance(again, Stop)
    assert again.exit_code == exitcodes.STOPPED == 93
    assert again.reason == ("IndexError: index 8 is out of range (raised again when step 5 was replayed: "
                            "a bug, not a fault)")
    assert "index 7 is out of range" in again.traceback and "_here" in again.traceback


def test_an_exception_again_at_a_later_step_is_a_bug_too() -> None:
    judge = _judge()
    assert isinstance(judge.failure(_here(KeyError("loss")), step=10, generation_moved=False), Failure)
    judge.progress()
    stop = judge.failure(_here(KeyError("loss")), step=30, generation_moved=False)
    assert isinstance(stop, Stop) and "at step 30, as at step 10" in stop.reason


def test_another_type_message_or_place_is_another_exception() -> None:
    judge = _judge()
    for exc in (_here(ValueError("bad batch 3")), _here(TypeError("bad batch 3")),
                _here(ValueError("bad label 3")), _elsewhere(ValueError("bad batch 3"))):
        assert isinstance(judge.failure(exc, step=1, generation_moved=False), Failure), exc


def test_a_collective_or_store_error_is_a_fault_however_often_it_comes() -> None:
    judge = _judge()
    for _ in range(5):
        for exc in (_here(RuntimeError("Connection closed by peer [127.0.0.1]:29500")),
                    _here(GenerationFailed("generation 3 was declared failed")),
                    _here(TimeoutError("store wait timed out"))):
            verdict = judge.failure(exc, step=4, generation_moved=False)
            assert isinstance(verdict, Failure) and verdict.kind is FailureKind.FAULT


def test_an_exception_while_the_generation_fails_is_a_consequence_never_a_verdict() -> None:
    judge = _judge()
    for _ in range(3):  # not remembered while the generation was moving
        assert isinstance(judge.failure(_here(ValueError("half a batch")), step=2, generation_moved=True), Failure)
    assert isinstance(judge.failure(_here(ValueError("half a batch")), step=2, generation_moved=False), Failure)
    assert isinstance(judge.failure(_here(ValueError("half a batch")), step=2, generation_moved=False), Stop)


def test_an_injected_exception_is_always_recovered() -> None:
    judge = _judge()
    for _ in range(3):
        exc = _here(RuntimeError("chaos: injected exception"))
        exc.injected = True  # type: ignore[attr-defined]  (what chaos.inject marks its faults with)
        assert isinstance(judge.failure(exc, step=3, generation_moved=False), Failure)


def test_a_misuse_stops_at_once_in_one_line() -> None:
    stop = _judge().failure(_here(UsageError("ctx.average_gradients() called twice")), step=0,
                            generation_moved=False)
    assert stop == Stop(reason="ctx.average_gradients() called twice", exit_code=exitcodes.STOPPED, traceback="")
    wrong = _judge().failure(_here(WrongInput("steps=5 is below the checkpoint's step 9")), step=9,
                             generation_moved=False)
    assert isinstance(wrong, Stop) and wrong.exit_code == exitcodes.BAD_INPUT == 2


def test_storage_faults_stop_with_their_exit_codes() -> None:
    full = _judge().failure(_here(OSError(errno.ENOSPC, "No space left on device")), step=1, generation_moved=False)
    assert isinstance(full, Stop) and full.exit_code == exitcodes.DISK_FULL == 28
    gone = _judge().failure(_here(UnwritableError("the run directory was removed")), step=1,
                            generation_moved=False)
    assert isinstance(gone, Stop) and gone.exit_code == exitcodes.STORAGE == 74


def test_a_world_that_never_assembles_fails_the_job() -> None:
    stop = _judge().failure(_here(JoinError("only 3 of 4 ranks joined generation 2")), step=0,
                            generation_moved=False)
    assert isinstance(stop, Stop) and stop.exit_code == exitcodes.FAILED and "3 of 4" in stop.reason


def test_the_recovery_budget_stops_the_job_naming_the_last_failure() -> None:
    judge = _judge(max_recoveries=2)
    failure = judge.failure(_here(GenerationFailed("rank 1 died")), step=1, generation_moved=False)
    assert isinstance(failure, Failure)
    assert judge.recovering(failure) is None
    judge.progress()
    assert judge.recovering(failure) is None
    judge.progress()
    stop = judge.recovering(failure)
    assert stop == Stop(reason="gave up after 2 recoveries (last: GenerationFailed: rank 1 died)",
                        exit_code=exitcodes.FAILED)


def test_generations_in_a_row_without_a_step_stop_the_job_and_progress_resets_them() -> None:
    judge = _judge(max_failed=2)
    failure = judge.failure(_here(GenerationFailed("rank 0 hung")), step=7, generation_moved=False)
    assert isinstance(failure, Failure)
    assert judge.recovering(failure) is None and judge.recovering(failure) is None
    judge.progress()  # a step completed: the count starts again
    assert judge.recovering(failure) is None and judge.recovering(failure) is None
    stop = judge.recovering(failure)
    assert isinstance(stop, Stop) and stop.exit_code == exitcodes.STOPPED
    assert stop.reason.startswith("3 generations in a row failed without completing a step")


def test_a_wake_that_was_a_stop_is_not_counted() -> None:
    judge = _judge(max_recoveries=1, max_failed=1)
    failure = judge.failure(_here(GenerationFailed("woken")), step=1, generation_moved=False)
    assert isinstance(failure, Failure)
    assert judge.recovering(failure) is None
    judge.not_recovering()
    assert (judge.recoveries, judge.without_progress) == (0, 0)
    assert judge.recovering(failure) is None  # still within both budgets of one
