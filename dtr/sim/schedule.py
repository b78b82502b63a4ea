"""Static schedules over a log's operator graph, and the one evaluator they all go through.

A schedule is a list of steps: ``("compute", OP)`` runs operator OP of the
exact :class:`~dtr.sim.graph.Graph`, ``("free", STORAGE)`` frees a storage.
In JSON (``dtr-sim export -o``) it is an object whose ``steps`` is a list of
``{"compute": OP}`` and ``{"free": STORAGE}`` (a bare list of steps is read as
well), with the log, planner and budget alongside for reference.

The evaluator (:func:`evaluate`) checks a schedule and measures it; it is
a deliberately independent model of the core's memory semantics, not a copy
of the core (see Note [Evaluator semantics]). Planners work on the planning graph
(:class:`~dtr.sim.graph.PlanGraph`) and produce a *compute sequence* of
nodes; :func:`sequence_steps` adds the frees (each value freed right after
its last use) and :func:`expand` turns them into exact steps.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence, Tuple

from dtr.errors import DtrError
from dtr.sim.graph import Graph, PlanGraph

__all__ = ["COMPUTE", "FREE", "Step", "Schedule", "Evaluation", "ScheduleError", "evaluate", "sequence_steps",
           "sequence_profile", "in_place_frees", "expand", "plan_schedule", "load_schedule", "save_schedule",
           "named_os_error", "out_of_order"]

COMPUTE = "compute"
FREE = "free"
Step = Tuple[str, int]


class ScheduleError(DtrError):
    """A schedule file that cannot be read, or a compute sequence a planner got wrong."""


@dataclass(frozen=True)
class Schedule:
    """A static schedule over an exact graph.

    Attributes:
        steps: ``(COMPUTE, op)`` and ``(FREE, storage)`` in order.
        meta: what produced it (log, planner, budget...), kept in the JSON.
    """

    steps: Tuple[Step, ...]
    meta: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"format": "dtr-schedule", "version": 1, **self.meta,
                "steps": [{k: x} for k, x in self.steps]}


@dataclass(frozen=True)
class Evaluation:
    """The evaluator's verdict on one schedule.

    Attributes:
        valid: every input resident when used (or handed over in place),
            every operator computed at least once, the tensors referenced at
            the end resident at the end, only resident storages freed (no
            constant the log keeps, and no freed constant recomputed), and
            (with a budget) peak <= budget.
        error: why it is not valid (None when valid); names the step.
        peak_bytes: the peak memory (up to the failing step when invalid).
        total_compute: the sum of the costs of the computed operators.
        base_compute: the log's own compute (each operator once).
        overhead: total / base.
        computes: compute steps.
        recomputes: compute steps of an operator already computed before.
        frees: free steps.
        budget_bytes: the budget checked against (None: none).
    """

    valid: bool
    error: Optional[str]
    peak_bytes: int
    total_compute: float
    base_compute: float
    overhead: float
    computes: int
    recomputes: int
    frees: int
    budget_bytes: Optional[int]


# Note [Evaluator semantics]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# The evaluator is a deliberately independent checker. It takes the graph as
# given (the core's tables: which operators, tensors and storages exist) but
# shares no code with the core's bookkeeping (csrc/core_*.cpp): it keeps its
# own residency, definedness and memory from the schedule's steps alone. So
# an exported DTR run that evaluates to the simulator's own peak and compute
# (tests/sim/test_schedules.py) checks the core's accounting against a second
# model, and a planner's schedule is judged by rules no planner shares. The
# rules are the core's memory semantics, written out again; a disagreement
# is a bug in one of the two, which the export tests are there to find:
# - memory counts resident storages (views are 0 bytes; constants count once
#   their operator ran);
# - ``compute OP`` needs every input tensor *defined*: its storage resident
#   and, for a view, its view operator run since the storage last came back
#   (freeing a storage undefines all its tensors), or handed over to OP in
#   place (Note [In-place writes in a schedule]). The operator's whole
#   fresh output size is allocated at once, on top of what is resident (this
#   is the step's transient peak); outputs whose storage was already resident
#   are then freed again (a recomputation duplicates them only transiently);
# - ``free S`` needs S resident. A constant (Graph.storage_constant) may be
#   freed only if the log drops it (none of its tensors is referenced at the
#   end: the runtime frees a constant whose last reference dies), and it
#   never comes back: computing its operator again is an error (a weight
#   cannot be recomputed);
# - at the end every tensor still referenced when the log ends
#   (Graph.referenced_at_end) must be defined, and every operator must have
#   been computed at least once (a planner may not skip the log's work);
# - total compute is the sum of the costs of all compute steps.

# Note [In-place writes in a schedule]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An in-place write (``x.relu_()``) computes a new version of the written
# storage from the old one (Graph.op_overwrites). The core runs it in place
# the first time: the old version is evicted and the new one takes over its
# bytes, so the write needs no extra memory (a recomputation later runs out
# of place, reading a resident old version, unless the log's semantics hand
# that over too: the core's Note [Handing bytes over on recomputation], whose
# trace frees the old version right before the recomputation). A schedule says the same with
# ``free OLD`` right before ``compute OP``: a storage that OP overwrites and
# that was freed by the free steps since the previous compute step is handed
# over to OP, whose inputs on it count as defined if they were when it was
# freed. The accounting is the core's: the old bytes go, then OP allocates
# its outputs. A schedule that keeps the old version resident until after OP
# (as the planners do) is valid too; it only peaks higher.


def evaluate(graph: Graph, steps: Iterable[Step], budget: Optional[int] = None) -> Evaluation:
    """Validate a schedule and measure its peak memory and total cost.

    A deliberately independent checker: it models the core's memory
    semantics from the graph alone and shares no code with the core, so that
    agreeing with the simulator's figures on an exported run means something
    (Note [Evaluator semantics]).

    Args:
        graph: the exact graph the schedule is over.
        steps: ``(COMPUTE, op)`` / ``(FREE, storage)`` pairs.
        budget: if given, a peak above it makes the schedule invalid.

    Returns:
        The :class:`Evaluation` (never raises for a bad schedule: ``valid`` is False).
    """
    g = graph
    n_ops, n_st = g.num_ops, g.num_storages
    resident = bytearray(n_st)
    defined = bytearray(len(g.tensor_op))
    computed = bytearray(n_ops)
    mem = peak = 0
    total = 0.0
    computes = recomputes = frees = 0
    error: Optional[str] = None
    op_inputs, op_alloc, op_fresh, op_outputs, op_cost = g.op_inputs, g.op_alloc, g.op_fresh, g.op_outputs, g.op_cost
    size, st_tensors, constant = g.storage_size, g.storage_tensors, g.storage_constant
    overwrites = g.op_overwrites
    overwritten = {s for ss in overwrites for s in ss}
    kept = {g.tensor_storage[t] for t in g.referenced_at_end}
    gone = bytearray(n_st)  # constants freed (never back)
    handed: dict = {}  # storage freed since the last compute step -> its tensors defined then
    for i, (kind, x) in enumerate(steps):
        if kind == COMPUTE:
            if not (isinstance(x, int) and 0 <= x < n_ops):
                error = f"step {i}: no operator {x!r}"
                break
            for t in op_inputs[x]:
                if not defined[t]:
                    s = g.tensor_storage[t]
                    if s in handed and t in handed[s] and s in overwrites[x]:
                        continue  # overwritten in place
                    error = (f"step {i}: compute op {x} ({g.op_name[x]}, log line {g.op_line[x]}): input tensor "
                             f"{t} (storage {s}) is not resident")
                    break
            if error:
                break
            for s in op_fresh[x]:
                if gone[s]:
                    error = (f"step {i}: compute op {x} (log line {g.op_line[x]}): constant storage {s} was freed "
                             f"and cannot be brought back")
                    break
            if error:
                break
            handed.clear()
            mem += op_alloc[x]
            if mem > peak:
                peak = mem
            for s in op_fresh[x]:
                if resident[s]:
                    mem -= size[s]
                else:
                    resident[s] = 1
            for t in op_outputs[x]:
                defined[t] = 1
            total += op_cost[x]
            computes += 1
            if computed[x]:
                recomputes += 1
            computed[x] = 1
        elif kind == FREE:
            if not (isinstance(x, int) and 0 <= x < n_st):
                error = f"step {i}: no storage {x!r}"
                break
            if not resident[x]:
                error = f"step {i}: free storage {x}: not resident"
                break
            if constant[x]:
                if x in kept:
                    error = f"step {i}: free storage {x}: a constant the log keeps cannot be freed"
                    break
                gone[x] = 1
            if x in overwritten:
                handed[x] = {t for t in st_tensors[x] if defined[t]}
            resident[x] = 0
            mem -= size[x]
            for t in st_tensors[x]:
                defined[t] = 0
            frees += 1
        else:
            error = f"step {i}: unknown step kind {kind!r} (valid: compute, free)"
            break
    if error is None:
        missing = [t for t in g.referenced_at_end if not defined[t]]
        if missing:
            t = missing[0]
            error = (f"end: {len(missing)} tensor(s) referenced at the end not resident, e.g. tensor {t} of op "
                     f"{g.tensor_op[t]} (log line {g.op_line[g.tensor_op[t]]})")
    if error is None and not all(computed):
        k = computed.index(0)
        error = f"end: op {k} ({g.op_name[k]}, log line {g.op_line[k]}) was never computed"
    if error is None and budget is not None and peak > budget:
        error = f"peak memory {peak} exceeds the budget {budget}"
    base = g.base_compute
    return Evaluation(valid=error is None, error=error, peak_bytes=peak, total_compute=total, base_compute=base,
                      overhead=total / base if base > 0 else 1.0, computes=computes, recomputes=recomputes,
                      frees=frees, budget_bytes=budget)


def sequence_steps(pg: PlanGraph, seq: Sequence[int]) -> List[Step]:
    """Steps for a compute sequence of nodes: each storage freed right after its last use.

    Returns ``(COMPUTE, node)`` and ``(FREE, storage)`` steps (exact storage
    ids; :func:`expand` turns the node computes into operators). A use reads
    the latest computation of the node before it. The last computation of a
    storage referenced at the end is kept, and so is a constant unless the log drops it
    (freed after its last use, at its node's last computation). An old
    version whose last use is the in-place write that overwrites it is freed
    right before the write, which then runs in place (Note [Planned frees]).

    Raises:
        ScheduleError: a node is used before any computation of it.
    """
    latest = [-1] * pg.n
    owner, reads = pg.storage_node, pg.reads
    last_use: List[dict] = []
    for p, v in enumerate(seq):
        for s in reads[v]:
            q = latest[owner[s]]
            if q < 0:
                raise ScheduleError(f"the sequence computes node {v} at position {p} before its input "
                                    f"{owner[s]}")
            last_use[q][s] = p
        latest[v] = p
        last_use.append({s: p for s in pg.storages[v]})
    keep = len(seq)
    for s in pg.storages_referenced_at_end:
        q = latest[owner[s]]
        if q >= 0:
            last_use[q][s] = keep
    in_place = in_place_frees(pg)
    frees: List[List[int]] = [[] for _ in range(len(seq))]
    before: List[List[int]] = [[] for _ in range(len(seq))]
    for p, v in enumerate(seq):
        if pg.pinned[v] and p != latest[v]:
            continue
        for s, u in last_use[p].items():
            if u < keep:
                (before if s in in_place[seq[u]] else frees)[u].append(s)
    steps: List[Step] = []
    for p, v in enumerate(seq):
        steps.extend((FREE, s) for s in before[p])
        steps.append((COMPUTE, v))
        steps.extend((FREE, s) for s in frees[p])
    return steps


# Note [Planned frees]
# ~~~~~~~~~~~~~~~~~~~~
# sequence_steps frees every storage after its last use, as the log's own
# program would, with two refinements that make the planners' schedules as
# frugal as the runtime's on the runtime's logs: a constant the log drops
# (none of its tensors referenced at the end: an input or an old gradient)
# is freed after its last use too, once its node will not be computed again
# (a freed constant never comes back); and an old version whose last use is
# the in-place write that overwrites it is freed right before the write,
# which then runs in place (Note [In-place writes in a schedule]), as the
# core does. The planners' own memory models do not count either saving
# (they treat the constants as always resident and the write as out of
# place), so their plans are, if anything, below the budget they aimed for.


def in_place_frees(pg: PlanGraph) -> List[frozenset]:
    """Per node, the storages its first operator overwrites in place and no later operator of it reads."""
    g = pg.graph
    overwrites = g.op_overwrites
    out: List[frozenset] = []
    for ops in pg.ops:
        ss = set(overwrites[ops[0]])
        for k in ops[1:]:
            ss.difference_update(g.tensor_storage[t] for t in g.op_inputs[k])
        out.append(frozenset(ss))
    return out


def sequence_profile(pg: PlanGraph, steps: Sequence[Step]) -> Tuple[int, float]:
    """Peak memory and total cost of :func:`sequence_steps`' steps (fast, no checks)."""
    mem = peak = 0
    cost = 0.0
    m, c, size = pg.mem, pg.cost, pg.graph.storage_size
    for kind, x in steps:
        if kind == COMPUTE:
            mem += m[x]
            if mem > peak:
                peak = mem
            cost += c[x]
        else:
            mem -= size[x]
    return peak, cost


def expand(pg: PlanGraph, steps: Sequence[Step]) -> List[Step]:
    """Exact steps for :func:`sequence_steps`' steps: a node's computes become its operators."""
    out: List[Step] = []
    for kind, x in steps:
        if kind == COMPUTE:
            out.extend((COMPUTE, k) for k in pg.ops[x])
        else:
            out.append((FREE, x))
    return out


# Note [Schedules a step can follow]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A runtime step runs its program: every op once, in the program's order
# (the log's, which is the planning graph's node order). A compute sequence
# that computes a node for the first time after a later node's first
# computation cannot be followed as it is: the step computes that node at its
# own turn anyway, so following the schedule would pay for one more
# computation and hold memory the schedule does not count. FastSA's grouping
# does this (a fused node first runs at its first reader), and its mutations
# may move a first computation past another's. Plans for a runtime step are
# made with ``PlanOptions.in_order`` (FastSA then anneals under the order;
# the other planners keep it always), and make_step_plan refuses a sequence
# that breaks it.


def out_of_order(seq: Sequence[int]) -> Optional[Tuple[int, int]]:
    """Where a compute sequence first breaks the graph's order (Note [Schedules a step can follow]).

    Args:
        seq: a planner's compute sequence of planning-graph nodes.

    Returns:
        ``(a, b)``: node ``b`` is computed for the first time after node ``a``'s
        first computation although ``b < a``; None when the first computations
        are in the graph's order.
    """
    seen = set()
    last = -1
    for v in seq:
        if v in seen:
            continue
        seen.add(v)
        if v < last:
            return last, v
        last = v
    return None


def plan_schedule(pg: PlanGraph, seq: Sequence[int], meta: Optional[dict] = None) -> Schedule:
    """The exact :class:`Schedule` of a planner's compute sequence."""
    return Schedule(steps=tuple(expand(pg, sequence_steps(pg, seq))), meta=dict(meta or {}))


def save_schedule(schedule: Schedule, path: str | os.PathLike) -> None:
    """Write a schedule as JSON (one step per line, readable with diff).

    Raises:
        OSError: the file cannot be written; its ``filename`` is ``path`` (a
            failed write names no file of its own).
    """
    doc = schedule.to_json()
    steps = doc.pop("steps")
    head = json.dumps(doc)[:-1]
    try:
        with open(path, "w") as f:
            f.write(head + (', ' if doc else '') + '"steps": [\n')
            f.write(",\n".join(json.dumps(s) for s in steps))
            f.write("\n]}\n")
    except OSError as e:
        raise named_os_error(e, path) from None


def named_os_error(e: OSError, path: str | os.PathLike) -> OSError:
    """``e`` with ``path`` as its file name where it names none (a write or a close that failed)."""
    if e.filename is not None:
        return e
    return OSError(e.errno, e.strerror or str(e), os.fspath(path))


def load_schedule(path: str | os.PathLike) -> Schedule:
    """Read a schedule written by :func:`save_schedule` (or a bare JSON list of steps).

    Raises:
        ScheduleError: not a readable schedule.
    """
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ScheduleError(f"{path}: cannot read the schedule: {e}") from None
    raw = doc if isinstance(doc, list) else doc.get("steps") if isinstance(doc, dict) else None
    if not isinstance(raw, list):
        raise ScheduleError(f"{path}: a schedule is a list of steps or an object with 'steps'")
    steps: List[Step] = []
    for i, s in enumerate(raw):
        if not (isinstance(s, dict) and len(s) == 1):
            raise ScheduleError(f"{path}: step {i}: expected {{\"compute\": OP}} or {{\"free\": STORAGE}}")
        ((k, x),) = s.items()
        if k not in (COMPUTE, FREE) or not isinstance(x, int):
            raise ScheduleError(f"{path}: step {i}: expected {{\"compute\": OP}} or {{\"free\": STORAGE}}")
        steps.append((k, x))
    meta = {k: v for k, v in doc.items() if k not in ("steps", "format", "version")} if isinstance(doc, dict) else {}
    return Schedule(steps=tuple(steps), meta=meta)
