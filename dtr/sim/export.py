"""DTR's online decisions frozen into a static schedule (``dtr-sim export``)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

from dtr.core import ReplayStatus, TraceEvent, replay_program
from dtr.errors import DtrError
from dtr.heuristics import Heuristic, get_heuristic
from dtr.sim.graph import Graph, PlanGraph, graph_from_log
from dtr.sim.logs import Log, read_log
from dtr.sim.schedule import COMPUTE, FREE, Schedule, ScheduleError, Step, sequence_profile, sequence_steps

__all__ = ["Export", "ExportError", "export_schedule", "node_sequence", "dtr_starts", "START_HEURISTICS"]


class ExportError(DtrError):
    """A DTR run that cannot be written as a schedule over the log's graph (see :func:`export_schedule`)."""


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
        needed_bytes: for ``oom``, bytes that had to be resident when the run failed (None otherwise).
        failed_line: for ``oom``/``thrash``, the log line being replayed (0: the output condition at the end).
    """

    graph: Graph
    schedule: Schedule
    status: str
    peak_bytes: int
    total_compute: float
    budget_bytes: Optional[int]
    needed_bytes: Optional[int] = None
    failed_line: Optional[int] = None


# Note [Exporting a DTR run]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# The core reports, in order, every operator it computes (first time or
# again; an operator without outputs once) and every storage it frees
# (evicted by the heuristic, freed at its last release, a dead constant,
# collected garbage, or a collected output that a recomputation of its
# operator brings back for an instant and the core frees at once). The exact
# graph is the core's own tables after a replay without a budget (Note [The
# exact graph is the core's] in csrc/replay.cpp), so the trace is the
# schedule: compute events become ``compute`` steps, evictions and frees
# ``free`` steps. Eviction by the heuristic happens before the operator that
# needed the room, as in the trace; an in-place write's old version is freed
# right before the write (Note [In-place writes in a schedule] in
# dtr.sim.schedule). The run uses the log's own semantics (Log.semantics),
# as ``dtr-sim replay`` does, so the schedule is the run replay reports.
# A run under a budget can still number things differently from the run
# without one: when its pinned set differs (that Note says how), an in-place
# write makes no new version in one run and one in the other. The export
# checks the run's operators and storages against the graph's and refuses
# such a run (_check_same_ids) rather than hand out a schedule that does not
# describe it. Banishing is not exported (a banished storage's dependents
# become constants, which a static schedule over the log's graph cannot
# express).


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

    Returns:
        The :class:`Export` (its schedule is complete only when the run's status is ``ok``).

    Raises:
        LogFormatError: ``log`` is a path to a bad log.
        ExportError: the run numbers operators or storages differently from
            the graph (Note [Exporting a DTR run]); the message names the
            first log line where they differ.
    """
    if not isinstance(log, Log):
        log = read_log(log)
    h = get_heuristic(heuristic) if isinstance(heuristic, str) else heuristic
    g = graph if graph is not None else graph_from_log(log)
    raw = replay_program(log.program, h, budget, thrash_limit=thrash_limit, trace=True, seed=seed, sample=sample,
                         semantics=log.semantics)
    _check_same_ids(g, raw, budget)
    steps = tuple((COMPUTE if kind in (TraceEvent.COMPUTED, TraceEvent.RECOMPUTED) else FREE, int(x))
                  for kind, x in raw["trace"])
    meta = {"log": g.name, "planner": h.name, "budget_bytes": budget, "status": raw["status"]}
    return Export(graph=g, schedule=Schedule(steps=steps, meta=meta), status=raw["status"],
                  peak_bytes=int(raw["peak_memory"]), total_compute=raw["base_compute"] + raw["remat_compute"],
                  budget_bytes=budget,
                  needed_bytes=int(raw["needed_bytes"]) if raw["status"] == ReplayStatus.OOM else None,
                  failed_line=int(raw["failed_line"]) if raw["status"] != ReplayStatus.OK else None)


def _check_same_ids(g: Graph, raw: dict, budget: Optional[int]) -> None:
    """Check that a run numbered its operators and storages as the graph does.

    The run's operators must be the graph's first ones (all of them when the
    run finished), and each storage it created must be the graph's storage of
    the same id: allocated by the same operator, at the same output position.
    A stopped run created only some of them. See Note [Exporting a DTR run].

    Args:
        g: the log's exact graph.
        raw: the run's raw result with ``trace`` (``op_instr``,
            ``storage_op``, ``storage_index``).
        budget: the run's budget (for the message).

    Raises:
        ExportError: they differ; names the log line of the first operator or
            storage that does.
    """
    finished = raw["status"] == ReplayStatus.OK

    def refuse(op: int, what: str) -> None:
        line = g.op_line[min(op, g.num_ops - 1)] if g.num_ops else 0
        raise ExportError(f"{g.name}:{line}: the run under budget {budget} bytes numbers {what} differently from "
                       f"the log's graph (the run without a budget; most likely this run pinned a storage that "
                       f"one does not, so that an in-place write made a new version in only one of them: Note "
                       f"[The exact graph is the core's] in csrc/replay.cpp); it cannot be exported as a "
                       f"schedule over the graph")

    run_instr = list(raw["op_instr"])
    n = len(run_instr)
    if run_instr != list(g.op_instr[:n]) or n > g.num_ops or (finished and n != g.num_ops):
        k = next((k for k, (a, b) in enumerate(zip(run_instr, g.op_instr)) if a != b), min(n, g.num_ops))
        refuse(k, f"operator {k}")
    run = list(zip(raw["storage_op"], raw["storage_index"]))
    m = min(len(run), g.num_storages)
    graph = [(g.storage_op[s], g.op_outputs[g.storage_op[s]].index(g.storage_tensors[s][0])) for s in range(m)]
    if run[:m] != graph or len(run) > g.num_storages or (finished and len(run) != g.num_storages):
        s = next((s for s, (a, b) in enumerate(zip(run, graph)) if a != b), m)
        refuse(g.storage_op[s] if s < g.num_storages else run[s][0], f"storage {s}")


# Note [DTR runs as starts]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# A static planner sees the whole graph, so it can take any schedule as a
# start and search for a cheaper one; the online heuristics' simulated runs
# are such schedules, and they often fit budgets where the planners' own
# starts do not (Chen's and Rotor's plans need chain-like graphs): on our
# TreeLSTM log at 50% of its peak only DTR's runs (``local`` 1.204x, ``lru``
# 1.272x, ``dtr`` 1.309x) found a schedule. So FastSA refines them and the
# ILP takes them as incumbents (with ``PlanOptions.warm_start``), and a
# planner seeded so never returns a schedule worse than the best run it was
# given. The planner's result message names its start.
# An exported run becomes a compute sequence of the planning graph's nodes
# by keeping each computation of a node's first operator (a node's other
# operators are its views and writes without outputs: Note [Collapsing views
# for planners]); sequence_steps then frees every storage after its last use,
# which is no later than the run freed it, and the sequence is kept only where
# sequence_profile (the planners' own memory model) puts it within the
# budget. Runs are replayed under the log's semantics with the CLI's thrash
# limit (3), cheapest heuristic first; the full ``dtr`` heuristic, up to
# DTR_SLOWDOWN times slower than ``eqclass`` (37x on the TreeLSTM log: 19 s),
# runs only where that estimate fits half the time left.

#: DTR's heuristics whose runs seed the planners, cheapest first (Note [DTR runs as starts]).
START_HEURISTICS = ("local", "lru", "eqclass", "dtr")
#: How much slower than ``eqclass`` the ``dtr`` heuristic's replay may be (measured up to 37x).
DTR_SLOWDOWN = 40.0


def node_sequence(pg: PlanGraph, steps: Sequence[Step]) -> List[int]:
    """The planning graph's compute sequence of an exported run's steps (Note [DTR runs as starts]).

    O(steps).
    """
    first = {ops[0]: v for v, ops in enumerate(pg.ops)}
    return [first[x] for kind, x in steps if kind == COMPUTE and x in first]


def dtr_starts(pg: PlanGraph, budget: int, deadline: Optional[float] = None,
               thrash_limit: float = 3.0) -> List[Tuple[float, str, List[int]]]:
    """Compute sequences from DTR's simulated runs that fit ``budget`` on the planners' model.

    See Note [DTR runs as starts]. Nothing when the graph does not carry its
    log (``Graph.log``).

    Args:
        pg: the planning graph (of a graph read by :func:`graph_from_log`).
        budget: bytes.
        deadline: a ``time.perf_counter()`` value: no replay starts after it
            (one already running finishes).
        thrash_limit: the runs' thrash limit.

    Returns:
        ``(cost, name, sequence)`` per run that fits, cheapest first.
    """
    log = pg.graph.log
    if log is None:
        return []
    out: List[Tuple[float, str, List[int]]] = []
    eqclass_seconds: Optional[float] = None
    for h in START_HEURISTICS:
        t0 = time.perf_counter()
        if deadline is not None:
            left = deadline - t0
            if left <= 0:
                break
            if h == "dtr" and (eqclass_seconds is None or DTR_SLOWDOWN * eqclass_seconds > 0.5 * left):
                continue
        try:
            ex = export_schedule(log, h, budget, thrash_limit=thrash_limit, graph=pg.graph)
        except ExportError:
            continue
        if h == "eqclass":
            eqclass_seconds = time.perf_counter() - t0
        if ex.status != ReplayStatus.OK:
            continue
        seq = node_sequence(pg, ex.schedule.steps)
        try:
            peak, cost = sequence_profile(pg, sequence_steps(pg, seq))
        except ScheduleError:  # (not seen: a run computes every input before its reader)
            continue
        if peak <= budget:
            out.append((cost, f"DTR's {h} run", seq))
    out.sort(key=lambda c: c[0])
    return out
