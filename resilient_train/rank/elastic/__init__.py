"""Elastic width: a job's fixed data-parallel width of logical ranks, hosted by however many processes live.

See docs/design.md, "Elastic width". :mod:`~resilient_train.rank.elastic.width` assigns logical ranks to the
processes of a generation; :mod:`~resilient_train.rank.elastic.ordered` sums their gradient contributions in
logical order, with bits that do not depend on that assignment.
"""

from resilient_train.rank.elastic.ordered import OrderedSum
from resilient_train.rank.elastic.width import Width, assign

__all__ = ["OrderedSum", "Width", "assign"]
