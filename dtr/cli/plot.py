"""``dtr-sim plot``: draw a CSV written by ``dtr-sim sweep``.

Light to import: matplotlib (through :mod:`dtr.sim.plot`) is imported inside
the command only.
"""
from __future__ import annotations

import argparse

from dtr.cli.common import command
from dtr.errors import DtrError

__all__ = ["COMMANDS"]


def _plot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("csv", metavar="FILE.csv", help="a CSV written by dtr-sim sweep")
    p.add_argument("-o", "--output", required=True, metavar="FILE.png",
                   help="the figure (PNG or SVG, by extension)")
    p.add_argument("--kind", choices=("overhead", "accesses"), default="overhead",
                   help="overhead vs budget (default) or storage accesses vs budget")
    p.add_argument("--heuristic", default=None, metavar="H1,H2", help="only these heuristics (default: all in the CSV)")


@command("plot", "plot a sweep CSV: overhead (or storage accesses) vs budget ratio per log", _plot_args)
def plot_command(args: argparse.Namespace) -> int:
    """Plot overhead (or storage accesses) vs budget ratio from a sweep CSV."""
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


#: The subcommands of this module.
COMMANDS = (plot_command,)
