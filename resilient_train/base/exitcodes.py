"""Exit codes of ranks and of the agent, in one table: every package reads them here.

(``resilient_train.base`` is the lowest layer: ``monitors``, ``checkpointing``, ``chaos`` and the
runtime import it, so a code is written once.)

=====  ======================================================================
code   meaning
=====  ======================================================================
0      the job finished (its final state is committed)
1      the script failed (torchrun's meaning: restarts spent, or none allowed)
2      bad input: a one-line error, before any worker started
16     rerun: a rank computed wrong results and was excluded (re-run elsewhere)
17     rerun: validation failed on a genuine event; the last good state is saved
75     preempted: a signal (SIGTERM, SIGUSR1) stopped every rank at one step
       boundary after a committed checkpoint (or one that did not commit in
       the grace, said so); start the job again (requeue). Every node's agent
       decides it from the ranks' records (resilient_train.protocol.shutdown)
28     stopped: the disk is full (a checkpoint or the final state could not be
       written; restarting would fail the same way)
74     stopped: the run directory cannot be written (its filesystem was
       remounted read-only, fails with I/O errors, or the directory was
       removed or replaced while the job ran); EX_IOERR
93     stopped, do not requeue: a bug (an exception that reproduced on its
       replay, or a plain script's same crash in two attempts in a row with
       no progress between), a misuse of the runtime
94     fenced: this node was declared lost (its agent stopped beating: its
       host died, or the agent was stopped while its ranks ran on), or, not
       being node 0, it lost the store (cut off, or node 0 gone: it cannot
       tell which, nor whether it was declared lost), so its ranks left
       without taking part or writing again; the job went on without this
       node (a spare node took its place, or the node's next agent rejoins),
       or stopped with node 0. Its ranks exit 94 too (cut off, they are
       killed by its agent). It is this node's fate, not the job's: the
       other nodes' agents exit with the job's outcome
128+N  the agent received signal N and forwarded it to a plain script's workers
=====  ======================================================================

16 and 17 are Megatron-Core's rerun codes; 93 is NVRx's "do not requeue".
"""

from __future__ import annotations

__all__ = ["BAD_INPUT", "DISK_FULL", "FAILED", "FENCED", "OK", "REQUEUE", "RERUN_ELSEWHERE", "STOPPED", "STORAGE",
           "VALIDATION_FAILED"]

OK = 0
FAILED = 1
BAD_INPUT = 2
RERUN_ELSEWHERE = 16
VALIDATION_FAILED = 17
DISK_FULL = 28  # ENOSPC's number on Linux
STORAGE = 74  # EX_IOERR: the run directory is read-only, failing or gone
STOPPED = 93
FENCED = 94  # this node was declared lost and fenced out; the job went on without it
REQUEUE = 75  # EX_TEMPFAIL: preempted, resume by starting again
