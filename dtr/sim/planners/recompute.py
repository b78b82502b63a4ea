"""Recomputing a missing value on demand: the rule Chen's and the hierarchical planner's sequences share."""
from __future__ import annotations

from typing import List, Optional, Sequence

__all__ = ["recompute_missing"]


def recompute_missing(deps: Sequence[Sequence[int]], avail: bytearray, root: int, seq: List[int],
                      fresh: Optional[List[int]] = None) -> None:
    """Append to ``seq`` what computing ``root`` from the available values takes, inputs first.

    Every node on the way that is not available is computed once, after its
    missing inputs (a post-order over the unavailable part of ``root``'s
    ancestry, iterative), and marked available.

    Args:
        deps: per node, the nodes it reads.
        avail: per node, 1 when its value is available; updated.
        root: the node wanted.
        seq: the compute sequence, extended in place.
        fresh: if given, gets every node computed here, in order.

    Complexity: O(the unavailable ancestry of ``root`` and its edges).
    """
    stack = [(root, False)]
    while stack:
        x, ready = stack.pop()
        if avail[x]:
            continue
        if ready:
            seq.append(x)
            avail[x] = 1
            if fresh is not None:
                fresh.append(x)
            continue
        stack.append((x, True))
        stack.extend((d, False) for d in deps[x] if not avail[d])
