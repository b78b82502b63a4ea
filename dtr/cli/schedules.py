"""``dtr-sim export`` and ``dtr-sim compare``: static schedules, exported from a replay or planned."""
from __future__ import annotations

import argparse
import math

from dtr.cli.common import (
    add_budget_option,
    add_heuristic_options,
    command,
    emit_json,
    heuristic_from_args,
    positive_seconds,
    seed_type,
    thrash_limit_type,
)
from dtr.errors import DtrError
from dtr.sim.planners import planner_names

__all__ = ["COMMANDS"]


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("log", help="path to the log")
    add_budget_option(p)
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write the schedule (JSON)")
    add_heuristic_options(p, default_limit=math.inf)


@command("export", "the simulator's run as a static schedule (JSON)", _export_args)
def export_command(args: argparse.Namespace) -> int:
    """Replay a log, export the run as a schedule, check it with the evaluator and save it."""
    from dtr.core import ReplayStatus
    from dtr.sim.export import export_schedule
    from dtr.sim.logs import read_log
    from dtr.sim.replay import baseline, resolve_budget
    from dtr.sim.schedule import evaluate, save_schedule
    log = read_log(args.log)
    budget = resolve_budget(args.budget, baseline(log)["peak_memory"])
    ex = export_schedule(log, heuristic_from_args(args), budget, thrash_limit=args.thrash_limit, seed=args.seed,
                         sample=args.sample)
    if ex.status == ReplayStatus.OOM:
        raise DtrError(f"the simulator stopped (oom) at budget {budget} bytes (log line {ex.failed_line or 'end'}): "
                       f"at least {ex.needed_bytes} bytes had to be resident at once, so there is no complete "
                       f"schedule to export; raise --budget to at least {ex.needed_bytes}")
    if ex.status != ReplayStatus.OK:
        raise DtrError(f"the simulator stopped ({ex.status}) at budget {budget} bytes (log line "
                       f"{ex.failed_line or 'end'}): recomputation passed --thrash-limit {args.thrash_limit:g}, so "
                       f"there is no complete schedule to export; raise the budget or the thrash limit")
    ev = evaluate(ex.graph, ex.schedule.steps, budget)
    save_schedule(ex.schedule, args.output)
    d = {"log": args.log, "heuristic": ex.schedule.meta["planner"], "budget_bytes": budget, "output": args.output,
         "steps": len(ex.schedule.steps), "valid": ev.valid, "peak_bytes": ev.peak_bytes,
         "total_compute": ev.total_compute, "base_compute": ev.base_compute, "overhead": ev.overhead,
         "simulator_peak_bytes": ex.peak_bytes, "simulator_total_compute": ex.total_compute}
    if args.json:
        emit_json(d)
    else:
        print(f"wrote {d['steps']} steps to {args.output}: valid {ev.valid}, peak {ev.peak_bytes} B, "
              f"compute {ev.total_compute:g} (overhead {ev.overhead:.4f}); simulator: peak {ex.peak_bytes} B, "
              f"compute {ex.total_compute:g}")
    return 0


def _compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("log", help="path to the log")
    g = p.add_mutually_exclusive_group(required=True)
    add_budget_option(g, help="one budget (as in replay)")
    g.add_argument("--budgets", metavar="START:STOP:STEP", help="ratios of the log's peak, STOP inclusive")
    p.add_argument("--planners", default="all", metavar="all|P1,P2",
                   help=f"{', '.join(planner_names())} (default: all)")
    p.add_argument("--heuristics", default="dtr,eqclass,local,lru", metavar="H1,H2",
                   help="DTR heuristics to include (default: dtr,eqclass,local,lru; 'none' for none)")
    p.add_argument("--time-limit", type=positive_seconds, default=60.0, metavar="S",
                   help="seconds for the ILP (and FastSA, hierarchical) per budget (default: 60)")
    p.add_argument("--seed", type=seed_type, default=0, help="seed of the randomized planners (default: 0)")
    p.add_argument("--cold", action="store_true",
                   help="planners search from scratch: no warm starts from Chen's, Rotor's or DTR's schedules")
    p.add_argument("--thrash-limit", type=thrash_limit_type, default=3.0, metavar="X",
                   help="the simulator's thrash limit (default: 3)")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.add_argument("--plot", metavar="FILE.png", help="draw overhead vs budget (with --budgets)")


@command("compare", "static planners and DTR heuristics on one log, through one evaluator", _compare_args)
def compare_command(args: argparse.Namespace) -> int:
    """Run the static planners and DTR heuristics on one log at one or more budgets."""
    from dtr.sim.compare import budget_range, compare, format_rows, plot_rows
    from dtr.sim.logs import read_log
    from dtr.sim.planners import PlanOptions, get_planner
    from dtr.sim.plot import check_figure_path
    from dtr.sim.replay import baseline, budget_from_ratio, resolve_budget
    names = planner_names() if args.planners == "all" else [x.strip() for x in args.planners.split(",") if x.strip()]
    for n in names:
        get_planner(n)
    heur = [] if args.heuristics == "none" else [x.strip() for x in args.heuristics.split(",") if x.strip()]
    if args.plot and not args.budgets:
        raise DtrError("--plot needs --budgets START:STOP:STEP")
    if args.plot:  # before the planners run, not after
        check_figure_path(args.plot)
    log = read_log(args.log)
    peak0 = baseline(log)["peak_memory"]
    if args.budgets:
        budgets = [budget_from_ratio(peak0, r) for r in budget_range(args.budgets)]
    else:
        one = resolve_budget(args.budget, peak0)
        assert one is not None  # (argparse requires --budget or --budgets)
        budgets = [one]
    rows = compare(log, budgets, names, heuristics=heur, thrash_limit=args.thrash_limit, baseline_peak=peak0,
                   options=PlanOptions(time_limit=args.time_limit, seed=args.seed, warm_start=not args.cold))
    if args.plot:
        plot_rows(rows, args.plot, title=f"{args.log}")
    if args.json:
        emit_json([r.to_dict() for r in rows])
    else:
        print(format_rows(rows))
    return 0


#: The subcommands of this module, in the order ``dtr-sim --help`` lists them.
COMMANDS = (export_command, compare_command)
