"""Which process computes which logical rank, in one generation.

An elastic job (``--nnodes MIN:MAX``) has a fixed data-parallel width W =
MAX nodes x ranks per node: logical ranks 0..W-1, each a data stream of its
own (its batch ``f(seed, step, data_rank)``, its RNG streams, its data
position). Its processes are its *slots* (``RANK``, 0..W-1 as well); a
generation's *members* are the slots that live in it. :func:`assign` maps
every logical rank to a member:

* **balanced**: every member hosts ``W // P`` or ``W // P + 1``;
* **stable**: a member keeps what it hosted in the generation before, as far
  as balance allows, so a shrink moves only the lost members' logical ranks
  and a grow moves as few as it must;
* **home first**: a member (re)joining takes back its own logical rank (the
  one equal to its slot) before any other, so a job grown back to full width
  is the identity again.

The same pure function runs in the planner; its result travels in the
generation's plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

__all__ = ["Width", "assign"]


def assign(width: int, members: Sequence[int], previous: Mapping[int, Sequence[int]] | None = None) -> list[int]:
    """The member (slot) that computes each logical rank 0..``width``-1.

    ``previous``: the logical ranks each member hosted in the generation before (a member absent from it, or
    an empty list, hosted none: it starts or comes back).
    """
    members = sorted(set(members))
    if not members:
        raise ValueError("a generation needs at least one member")
    if any(not 0 <= m < width for m in members):
        raise ValueError(f"members {members} out of the width {width}")
    p = len(members)
    low, extra = divmod(width, p)
    held: dict[int, list[int]] = {m: [] for m in members}
    taken: set[int] = set()
    for m in members:  # what each keeps, in logical order; duplicates (a stale report) go to the first claimer
        for logical in sorted((previous or {}).get(m, ())):
            if 0 <= logical < width and logical not in taken:
                held[m].append(logical)
                taken.add(logical)
    # Capacities: the members that held most keep the extra one (fewer moves), ties by slot.
    order = sorted(members, key=lambda m: (-len(held[m]), m))
    cap = {m: low + (1 if i < extra else 0) for i, m in enumerate(order)}
    free: list[int] = []
    for m in members:  # over capacity: give back the latest taken, never the member's own home rank first
        while len(held[m]) > cap[m]:
            spare = max((x for x in held[m] if x != m), default=held[m][-1])
            held[m].remove(spare)
            free.append(spare)
    free += [x for x in range(width) if x not in taken]
    free = sorted(set(free))
    for m in members:  # home first: a member under capacity takes its own logical rank back when it is free
        if len(held[m]) < cap[m] and m in free:
            held[m].append(m)
            free.remove(m)
    for m in members:  # the rest, lowest first, to the members under capacity, in slot order
        while len(held[m]) < cap[m]:
            held[m].append(free.pop(0))
    out = [-1] * width
    for m, logicals in held.items():
        for logical in logicals:
            out[logical] = m
    assert -1 not in out and not free, (out, free)
    return out


@dataclass(frozen=True)
class Width:
    """One generation's layout: its members and who hosts each logical rank (``hosts[logical]`` = a slot)."""

    members: tuple[int, ...]  # sorted slots
    hosts: tuple[int, ...]

    @classmethod
    def full(cls, width: int) -> "Width":
        """Every slot a member, each hosting its own logical rank (a fixed-width job)."""
        return cls(tuple(range(width)), tuple(range(width)))

    @property
    def width(self) -> int:
        return len(self.hosts)

    @property
    def size(self) -> int:
        """The generation's process count (its group's size)."""
        return len(self.members)

    @property
    def identity(self) -> bool:
        return self.size == self.width and all(h == i for i, h in enumerate(self.hosts))

    def group_rank(self, slot: int) -> int:
        return self.members.index(slot)

    def hosted(self, slot: int) -> list[int]:
        """The logical ranks ``slot`` computes, in logical order."""
        return [logical for logical, h in enumerate(self.hosts) if h == slot]

    def by_group_rank(self) -> list[list[int]]:
        """For each group rank, the logical ranks it computes."""
        out: list[list[int]] = [[] for _ in self.members]
        for logical, h in enumerate(self.hosts):
            out[self.members.index(h)].append(logical)
        return out

    def to_json(self) -> dict:
        return {"members": list(self.members), "hosts": list(self.hosts)}

    @classmethod
    def from_json(cls, d: dict) -> "Width":
        return cls(tuple(int(m) for m in d["members"]), tuple(int(h) for h in d["hosts"]))
