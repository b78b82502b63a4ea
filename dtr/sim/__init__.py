"""The offline simulator: replay operator logs under any budget and heuristic.

Library only (the command line, ``dtr-sim``, is :mod:`dtr.cli`). Torch-free:
``dtr-sim replay`` never imports torch.
"""
from dtr.sim.chain import chain_budget, chain_log
from dtr.sim.logs import Log, Record, parse_text, read_log
from dtr.sim.replay import ReplayResult, replay, resolve_budget

__all__ = ["Log", "Record", "ReplayResult", "chain_budget", "chain_log", "parse_text", "read_log", "replay",
           "resolve_budget"]
