"""Memory traces and scaling runs of the linear-chain toy model (simrd sections 5.1-5.2).

:func:`memory_trace` rebuilds, from the core's event trace, which storages are
resident at every computation step of a replay; :func:`chain_trace` folds the
chain's forward tensor t_i and its gradient g_i onto one row, as the paper's
Figures 7-10 do. :func:`chain_scaling` measures extra computations against n
(Figures 2-3). Plotting is in :mod:`dtr.sim.plot`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence, Tuple, Union

from dtr.core import TraceEvent
from dtr.heuristics import Heuristic, get_heuristic

__all__ = ["MemoryTrace", "ChainPoint", "memory_trace", "chain_trace", "chain_scaling",
           "EMPTY", "RESIDENT", "GRADIENT"]

EMPTY, RESIDENT, GRADIENT = 0, 1, 2

# Event kinds of dtr.core.replay_program(..., trace=True) that make storages resident, and that free them.
_MADE = (TraceEvent.COMPUTED, TraceEvent.RECOMPUTED)
_GONE = (TraceEvent.EVICTED, TraceEvent.FREED)


@dataclass(frozen=True)
class MemoryTrace:
    """Which tensors are resident at each computation step of one replay.

    Attributes:
        title: what was replayed (log, heuristic, budget).
        rows: row labels, bottom row first (tensor ids, or ``"layer i"`` for chains).
        cells: ``cells[row][step]``: :data:`EMPTY`, :data:`RESIDENT` or
            :data:`GRADIENT` (a chain's gradient tensor, drawn brighter).
        heuristic: the heuristic's name.
        budget: the budget in bytes.
        extra_compute: compute spent on rematerialization.
        status: the replay's status (``ok``, ``oom``, ``thrash``).
    """

    title: str
    rows: Tuple[str, ...]
    cells: Tuple[Tuple[int, ...], ...]
    heuristic: str
    budget: int
    extra_compute: float
    status: str

    @property
    def steps(self) -> int:
        """Number of computation steps (first computations plus recomputations)."""
        return len(self.cells[0]) if self.cells else 0


@dataclass(frozen=True)
class ChainPoint:
    """One chain run for :func:`chain_scaling`.

    Attributes:
        n: number of layers.
        heuristic: the heuristic's name.
        budget_spec: ``"sqrt"`` (ceil(2 sqrt n)), ``"log"`` (ceil(log2 n)) or a number.
        budget: the budget in unit tensors.
        extra_compute: computations beyond the 2n + 1 of the plain run.
        status: ``ok``, ``oom`` or ``thrash``.
    """

    n: int
    heuristic: str
    budget_spec: str
    budget: int
    extra_compute: float
    status: str


# Note [Rebuilding residency from the core's trace]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The core reports events, not states (TraceEvent): (COMPUTED, op),
# (RECOMPUTED, op), (EVICTED, storage) by the heuristic, (FREED, storage) at its
# last release, collected or banished. Every computation is one time step (one column); the column is
# the set of resident storages right after that computation, so evictions made
# to fit it are already visible and frees that follow it show in the next
# column. A (re)computed op makes every storage it allocates resident again
# (storage_op maps storages to their allocating op). Storage labels come from
# the log: op_instr maps a core op to its instruction in Log.records(), and
# storage_index to the output position.


def _events(log, heuristic, budget: int, banish: bool, thrash_limit: float):
    from dtr.core import replay_program
    h = get_heuristic(heuristic) if isinstance(heuristic, str) else heuristic
    raw = replay_program(log.program, h, budget, thrash_limit=thrash_limit, banish=banish, trace=True,
                         semantics=log.semantics)
    return h, raw


def _residency(raw) -> Tuple[List[List[int]], int]:
    """Per storage, the steps where it is resident; and the number of steps."""
    op_storages: Dict[int, List[int]] = {}
    for s, op in enumerate(raw["storage_op"]):
        op_storages.setdefault(op, []).append(s)
    resident: set = set()
    spans: List[List[int]] = [[] for _ in raw["storage_op"]]
    step = 0
    for kind, ident in raw["trace"]:
        if kind in _MADE:
            resident.update(op_storages.get(ident, ()))
            for s in resident:
                spans[s].append(step)
            step += 1
        elif kind in _GONE:
            resident.discard(ident)
    return spans, step


def memory_trace(log, heuristic: Union[str, Heuristic], budget: int, *, banish: bool = False,
                 thrash_limit: float = math.inf) -> MemoryTrace:
    """The residency of every storage at every computation step, one row per storage.

    Args:
        log: a parsed :class:`~dtr.sim.logs.Log`.
        heuristic: a registered name or a :class:`Heuristic`.
        budget: bytes.
        banish: banish on last release instead of eager eviction.
        thrash_limit: stop once total compute passes this multiple of the base.

    Returns:
        A :class:`MemoryTrace` with rows in allocation order, labelled by the
        tensor id that allocated each storage.

    Raises:
        ValueError: an unknown heuristic name.
    """
    h, raw = _events(log, heuristic, budget, banish, thrash_limit)
    spans, steps = _residency(raw)
    records = list(log.records())
    labels = []
    for s, op in enumerate(raw["storage_op"]):
        outs = records[raw["op_instr"][op]].outputs
        idx = raw["storage_index"][s]
        labels.append(outs[idx] if idx < len(outs) else f"storage {s}")
    cells = []
    for span in spans:
        row = [EMPTY] * steps
        for t in span:
            row[t] = RESIDENT
        cells.append(tuple(row))
    return MemoryTrace(title=f"{log.path}: {h.name}, budget {budget}", rows=tuple(labels), cells=tuple(cells),
                       heuristic=h.name, budget=budget, extra_compute=raw["remat_compute"], status=raw["status"])


def chain_trace(n: int, heuristic: Union[str, Heuristic], budget: Union[str, int], *,
                thrash_limit: float = math.inf) -> MemoryTrace:
    """The memory trace of the n-layer chain, banishing as in the paper's Figures 7-10.

    Row i (bottom = layer 0) shows the forward tensor t_i as :data:`RESIDENT` and
    its gradient g_i as :data:`GRADIENT` (the gradient wins when both are resident).

    Args:
        n: number of layers (the paper uses 101).
        heuristic: a registered name or a :class:`Heuristic`.
        budget: ``"sqrt"``, ``"log"`` or a number of unit tensors (see
            :func:`dtr.sim.chain_budget`).
        thrash_limit: stop once total compute passes this multiple of the base.

    Raises:
        ValueError: n < 1, an unknown budget spec or heuristic.
    """
    from dtr.sim.chain import chain_budget, chain_log
    from dtr.sim.logs import parse_text
    log = parse_text(chain_log(n), path=f"<chain n={n}>")
    b = chain_budget(n, budget)
    h, raw = _events(log, heuristic, b, True, thrash_limit)
    spans, steps = _residency(raw)
    records = list(log.records())
    grid = [[EMPTY] * steps for _ in range(n + 1)]
    for s, op in enumerate(raw["storage_op"]):
        name = records[raw["op_instr"][op]].outputs[raw["storage_index"][s]]
        layer, value = int(name[1:]), (GRADIENT if name[0] == "g" else RESIDENT)
        row = grid[layer]
        for t in spans[s]:
            if value > row[t]:
                row[t] = value
    spec = {"sqrt": "ceil(2 sqrt n)", "log": "ceil(log2 n)"}.get(str(budget), str(budget))
    return MemoryTrace(title=f"chain n={n}, {h.name}, B = {spec} = {b}", rows=tuple(f"layer {i}" for i in range(n + 1)),
                       cells=tuple(tuple(r) for r in grid), heuristic=h.name, budget=b,
                       extra_compute=raw["remat_compute"], status=raw["status"])


def chain_scaling(ns: Iterable[int], heuristics: Sequence[Union[str, Heuristic]], budget: str = "sqrt", *,
                  thrash_limit: float = math.inf, eager: bool = False) -> List[ChainPoint]:
    """Extra computations of the chain against n, as ``dtr-sim chain`` runs it.

    Args:
        ns: numbers of layers.
        heuristics: names or :class:`Heuristic` objects.
        budget: ``"sqrt"``, ``"log"`` or a number of unit tensors.
        thrash_limit: stop a run once total compute passes this multiple of 2n + 1.
        eager: eager eviction instead of banishing (the paper banishes).

    Returns:
        One point per (n, heuristic), n-major.

    Raises:
        ValueError: n < 1, an unknown budget spec or heuristic.
    """
    from dtr.sim.chain import chain_budget, chain_log
    from dtr.sim.logs import parse_text
    from dtr.sim.replay import replay
    points = []
    for n in ns:
        log = parse_text(chain_log(n), path=f"<chain n={n}>")
        b = chain_budget(n, budget)
        for h in heuristics:
            res = replay(log, h, b, thrash_limit=thrash_limit, banish=not eager)
            points.append(ChainPoint(n=n, heuristic=res.heuristic, budget_spec=str(budget), budget=b,
                                     extra_compute=res.total_compute - res.base_compute, status=res.status))
    return points
