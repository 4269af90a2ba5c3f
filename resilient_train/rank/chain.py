"""The reducer's chain of collectives: one in flight at a time, each launched when the one before it ended.

gloo's collectives cannot be aborted. With several in flight, two ranks could
each wait in one for the other until the group's timeout, and a group whose
worker threads still run one cannot be torn down. So a rank's reductions of a
step (its buckets, then its vote) go out one by one, each launched from
gloo's thread when the one before it ended: no thread of the rank ever waits
on a gloo collective itself, and a failed one ends the chain, which hands the
error to whoever waits (``on_failure``: the reducer fails every bucket's
future of the step). A new step starts a new epoch, so a late callback of an
abandoned step never launches anything of the next one.

Two kinds of item: a sum (``all_reduce``, divided after when asked), and an
ordered average over logical ranks (:func:`resilient_train.rank.elastic.ordered.launch_ordered`:
an all-to-all, then an all-gather, both in the chain).
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from resilient_train.rank.elastic.ordered import OrderedSum, launch_ordered

__all__ = ["ReductionChain", "settle"]


def settle(fut: torch.futures.Future, *, result: Any = None, error: Exception | None = None) -> None:
    """Completes ``fut`` unless it is already: an abort and a collective's end may race."""
    if fut.done():
        return
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except RuntimeError:  # completed meanwhile by the other side of the race
        pass


class ReductionChain:
    def __init__(self, on_failure: Callable[[Exception], None]) -> None:
        self._on_failure = on_failure
        self._lock = threading.Lock()  # shared with gloo's thread
        self._epoch = 0
        self.new_epoch()

    def new_epoch(self) -> None:
        """A new step: whatever the last one left behind never launches."""
        with self._lock:
            self._epoch += 1
            self._queue: collections.deque = collections.deque()
            self._busy = False
            self._stopped = False

    def stop_all(self) -> None:
        """Nothing queued goes out any more (an abort, from any thread)."""
        with self._lock:
            self._stopped = True
            self._queue.clear()

    def sum(self, tensor: torch.Tensor, done: torch.futures.Future, *, divide_by: int, group: Any) -> None:
        """``tensor`` summed across ``group`` (then divided by ``divide_by`` unless it is 1) into ``done``."""
        self._enqueue(("sum", tensor, done, divide_by, group))

    def ordered(self, tensor: torch.Tensor, done: torch.futures.Future, *, layout: OrderedSum,
                contributions: Mapping[int, torch.Tensor], group: Any) -> None:
        """The logical contributions' ordered average into ``tensor``, then ``done``."""
        self._enqueue(("ordered", tensor, done, layout, contributions, group))

    def _enqueue(self, item: tuple) -> None:
        with self._lock:
            self._queue.append(item)
            if self._busy:
                return
            self._busy = True
            epoch = self._epoch
        self._launch_next(epoch)

    def _launch_next(self, epoch: int) -> None:
        with self._lock:
            if epoch != self._epoch:
                return  # a step abandoned: its chain ends here
            if self._stopped or not self._queue:
                self._busy = False
                return
            item = self._queue.popleft()
        try:
            if item[0] == "ordered":
                _, tensor, done, layout, contributions, group = item
                launch_ordered(layout, contributions, tensor, group,
                               lambda error: self._finished(error, tensor, done, 1, epoch))
                return
            _, tensor, done, divide_by, group = item
            work = dist.all_reduce(tensor, group=group, async_op=True)  # a sum: divided after
        except Exception as e:  # noqa: BLE001  (handed to whoever waits on the bucket)
            self._on_failure(e)
            return
        work.get_future().then(lambda f: self._finished(_error_of(f), tensor, done, divide_by, epoch))

    def _finished(self, error: BaseException | None, tensor: torch.Tensor, done: torch.futures.Future,
                  divide_by: int, epoch: int) -> None:
        if error is not None:  # handed to whoever waits on the bucket, and on the ones after it
            failure = error if isinstance(error, Exception) else RuntimeError(repr(error))
            settle(done, error=failure)
            with self._lock:
                if epoch != self._epoch:
                    return
                self._stopped = True
                self._queue.clear()
            self._on_failure(failure)
            return
        if divide_by > 1:
            tensor.div_(divide_by)
        settle(done, result=tensor)
        self._launch_next(epoch)


def _error_of(f: torch.futures.Future) -> BaseException | None:
    try:
        f.value()  # raises the reduction's error, if any
    except BaseException as e:  # noqa: BLE001
        return e
    return None
