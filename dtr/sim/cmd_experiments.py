"""``dtr-sim sweep`` and ``dtr-sim plot``: budget sweeps and their figures.

Light to import: the sweep machinery and matplotlib are imported inside the
command functions only.
"""
from __future__ import annotations

import argparse
import sys
import time

from dtr.errors import DtrError
from dtr.sim.commands import command, thrash_limit_type

__all__: list = []  # registers subcommands; nothing to import from here


def _sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("logs", nargs="+", metavar="LOG", help="logs to replay (v1 or simrd, gzip or not)")
    p.add_argument("--heuristic", default="all", metavar="all|H1,H2",
                   help="'all' (default) or a comma-separated list of heuristics")
    p.add_argument("--budgets", default="0.1:1.0:0.05", metavar="START:STOP:STEP",
                   help="budget ratios of each log's own peak without eviction, STOP included "
                        "(default: 0.1:1.0:0.05); also a comma list such as 0.2,0.5")
    p.add_argument("--out", required=True, metavar="FILE.csv",
                   help="CSV to write; rows already in it are skipped and the rest appended")
    p.add_argument("--jobs", type=int, default=None, metavar="N", help="worker processes (default: one per CPU)")
    p.add_argument("--thrash-limit", type=thrash_limit_type, default=3.0, metavar="X",
                   help="stop a run once total compute passes X times the base compute (default: 3)")
    p.add_argument("--progress", action="store_true",
                   help="show a progress line on stderr even when it is not a terminal")


class _ProgressLine:
    """A one-line progress display on stderr, rewritten in place."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.start = time.perf_counter()
        self.last = 0.0
        self.tty = stream.isatty()

    def __call__(self, done: int, total: int, row) -> None:
        now = time.perf_counter()
        if done < total and now - self.last < 0.1:
            return
        self.last = now
        width = 30
        fill = int(width * done / total) if total else width
        elapsed = now - self.start
        eta = elapsed / done * (total - done) if done else 0.0
        line = (f"sweep [{'#' * fill}{'.' * (width - fill)}] {done}/{total}  {elapsed:.0f}s elapsed, "
                f"~{eta:.0f}s left  {row.model} {row.heuristic} {row.budget_ratio:g}")
        if self.tty:
            self.stream.write("\r" + line[:120].ljust(120))
            if done == total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


@command("sweep", "replay logs x heuristics x budget ratios into a CSV", _sweep_args)
def _sweep(args: argparse.Namespace) -> int:
    from dtr.sim.sweep import parse_heuristics, parse_ratios, sweep
    heuristics = parse_heuristics(args.heuristic)
    ratios = parse_ratios(args.budgets)
    if args.jobs is not None and args.jobs < 1:
        raise DtrError(f"--jobs must be at least 1 (got {args.jobs})")
    show = args.progress or sys.stderr.isatty()
    line = _ProgressLine(sys.stderr) if show else None
    ran = [0]

    def progress(done: int, total: int, row) -> None:
        ran[0] = done
        if line is not None:
            line(done, total, row)

    start = time.perf_counter()
    rows = sweep(args.logs, heuristics, ratios, thrash_limit=args.thrash_limit, jobs=args.jobs, out=args.out,
                 progress=progress)
    print(f"{len(rows)} runs ({len(set(r.log for r in rows))} logs x {len(heuristics)} heuristics x "
          f"{len(ratios)} ratios): {ran[0]} run, {len(rows) - ran[0]} already in {args.out}; "
          f"{time.perf_counter() - start:.1f} s")
    return 0


def _plot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("csv", metavar="FILE.csv", help="a CSV written by dtr-sim sweep")
    p.add_argument("-o", "--output", required=True, metavar="FILE.png",
                   help="the figure (PNG or SVG, by extension)")
    p.add_argument("--kind", choices=("overhead", "accesses"), default="overhead",
                   help="overhead vs budget (default) or storage accesses vs budget")
    p.add_argument("--heuristic", default=None, metavar="H1,H2", help="only these heuristics (default: all in the CSV)")


@command("plot", "plot a sweep CSV: overhead (or storage accesses) vs budget ratio per log", _plot_args)
def _plot(args: argparse.Namespace) -> int:
    from dtr.sim.plot import check_figure_path, plot_accesses, plot_overhead
    from dtr.sim.sweep import read_rows
    check_figure_path(args.output)
    rows = read_rows(args.csv)
    if args.heuristic:
        wanted = [h.strip() for h in args.heuristic.split(",") if h.strip()]
        present = sorted({r.heuristic for r in rows})
        unknown = [h for h in wanted if h not in present]
        if unknown:
            raise DtrError(f"{args.csv} has no rows for {', '.join(unknown)} (present: {', '.join(present)})")
        rows = [r for r in rows if r.heuristic in wanted]
    if not rows:
        raise DtrError(f"{args.csv}: no rows to plot")
    (plot_overhead if args.kind == "overhead" else plot_accesses)(rows, args.output)
    print(f"wrote {args.output}")
    return 0
