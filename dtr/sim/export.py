"""DTR's online decisions frozen into a static schedule (``dtr-sim export``)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

from dtr.core import replay_program
from dtr.errors import DtrError
from dtr.heuristics import Heuristic, get_heuristic
from dtr.sim.graph import Graph, graph_from_log
from dtr.sim.logs import Log, read_log
from dtr.sim.schedule import COMPUTE, FREE, Schedule

__all__ = ["Export", "export_schedule"]


@dataclass(frozen=True)
class Export:
    """One DTR run as a schedule.

    Attributes:
        graph: the exact graph of the log.
        schedule: the run's steps (complete only when ``status`` is ``ok``).
        status: the simulator's status (``ok``, ``oom``, ``thrash``).
        peak_bytes: the simulator's peak memory.
        total_compute: the simulator's base + remat compute.
        budget_bytes: the budget.
    """

    graph: Graph
    schedule: Schedule
    status: str
    peak_bytes: int
    total_compute: float
    budget_bytes: Optional[int]


# Note [Exporting a DTR run]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# The core reports, in order, every operator it computes (first time or
# again) and every storage it frees (evicted by the heuristic, or freed at its
# last release). The exact graph numbers operators and storages exactly as the
# core does (checked here against the core's storage -> operator map), so the
# trace is the schedule: compute events become ``compute`` steps, evictions
# and frees ``free`` steps. Eviction by the heuristic happens before the
# operator that needed the room, as in the trace. Banishing is not exported
# (a banished storage's dependents become constants, which a static schedule
# over the log's graph cannot express).


def export_schedule(log: Union[Log, str], heuristic: Union[Heuristic, str] = "eqclass",
                    budget: Optional[int] = None, *, thrash_limit: float = math.inf, seed: int = 0,
                    sample: int = 0, graph: Optional[Graph] = None) -> Export:
    """Replay a log under a budget and return the run as a static schedule.

    Args:
        log: a parsed log or a path.
        heuristic: a registered name or a :class:`Heuristic`.
        budget: bytes (already resolved), None for no limit.
        thrash_limit: as in :func:`dtr.sim.replay.replay` (default: none).
        seed: seed of the ``random`` heuristic and of sampling.
        sample: see :func:`dtr.sim.replay.replay`.
        graph: the log's exact graph, if already extracted.

    Raises:
        DtrError: the core's numbering does not match the extracted graph (a bug).
    """
    if not isinstance(log, Log):
        log = read_log(log)
    h = get_heuristic(heuristic) if isinstance(heuristic, str) else heuristic
    g = graph if graph is not None else graph_from_log(log)
    raw = replay_program(log.program, h, budget, thrash_limit=thrash_limit, trace=True, seed=seed, sample=sample)
    core_storage_op = list(raw["storage_op"])  # shorter when the run stopped early
    if core_storage_op != list(g.storage_op[:len(core_storage_op)]):
        raise DtrError("the simulator's storages do not match the extracted graph (please report this)")
    steps = tuple((COMPUTE if kind in (0, 1) else FREE, int(x)) for kind, x in raw["trace"])
    meta = {"log": g.name, "planner": h.name, "budget_bytes": budget, "status": raw["status"]}
    return Export(graph=g, schedule=Schedule(steps=steps, meta=meta), status=raw["status"],
                  peak_bytes=int(raw["peak_memory"]), total_compute=raw["base_compute"] + raw["remat_compute"],
                  budget_bytes=budget)
