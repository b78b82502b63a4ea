"""``dtr-sim sweep``: replay logs x heuristics x budget ratios into a CSV (``dtr-sim plot`` draws it).

Light to import: the sweep machinery (and its process pool) is imported inside
the command only.
"""
from __future__ import annotations

import argparse
import sys
import time

from dtr.cli.common import command, thrash_limit_type
from dtr.errors import DtrError

__all__ = ["COMMANDS"]


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
def sweep_command(args: argparse.Namespace) -> int:
    """Run the sweep (skipping rows already in --out) and print what ran."""
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


#: The subcommands of this module.
COMMANDS = (sweep_command,)
