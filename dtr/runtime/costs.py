"""Cost models: how much an operator costs, in the unit the log's meta line names.

``time`` measures each op in ns (dtr/runtime/timing.py): on CPU the host wall
time around the call; on CUDA with a pair of timing events on the current
stream, resolved lazily a few ops later, so that measuring needs no device
synchronization per op (the op ends with a provisional cost, and the core
learns the real one through ``Core.set_cost``; recording a log waits for each
op instead). ``flops`` is a deterministic
estimate: matrix products and convolutions by PyTorch's flop formulas, every
other op by the elements it reads and writes. With ``flops`` the runtime's clock
(staleness) is the sum of modelled costs, so its decisions are reproducible.
"""
from __future__ import annotations

from typing import Dict, Sequence

import torch

__all__ = ["CostModel", "get_cost_model", "COST_MODELS"]

COST_MODELS = ("time", "flops")


class CostModel:
    """Base: ``unit`` names the cost unit; ``measured`` says whether the op must be timed."""

    unit = "ns"
    measured = True

    def estimate(self, func, args, kwargs, outs: Sequence[torch.Tensor]) -> float:  # pragma: no cover
        raise NotImplementedError


class TimeModel(CostModel):
    """Time of the op, in ns (measured by the runtime's timer for the budget's device)."""

    unit = "ns"
    measured = True


class FlopModel(CostModel):
    """Deterministic flop estimate (the log's unit is "flop")."""

    unit = "flop"
    measured = False

    def __init__(self) -> None:
        from torch.utils.flop_counter import flop_registry
        self._registry = flop_registry
        self._cache: Dict[tuple, float] = {}

    def estimate(self, func, args, kwargs, outs: Sequence[torch.Tensor]) -> float:
        formula = self._registry.get(func._overloadpacket)
        if formula is not None:
            shapes = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args
                           if isinstance(a, (torch.Tensor, bool, int)))
            key = (func, shapes, tuple(tuple(o.shape) for o in outs))
            cost = self._cache.get(key)
            if cost is None:
                try:
                    # The registry's formulas are wrapped by torch's shape_wrapper: they take the
                    # op's real arguments and its result as ``out_val`` (as FlopCounterMode calls them).
                    out_val = tuple(outs) if len(outs) != 1 else outs[0]
                    cost = float(formula(*args, **kwargs, out_val=out_val))
                except Exception:  # a formula that does not fit this overload: count elements
                    cost = None
                if cost is None:
                    cost = self._elementwise(args, outs)
                self._cache[key] = cost
            return cost
        return self._elementwise(args, outs)

    @staticmethod
    def _elementwise(args, outs) -> float:
        n = sum(o.numel() for o in outs)
        n += sum(a.numel() for a in args if isinstance(a, torch.Tensor))
        return float(max(n, 1))


def get_cost_model(name: str) -> CostModel:
    """The cost model called ``name``.

    Raises:
        ValueError: an unknown name (the message lists the valid ones).
    """
    if name == "time":
        return TimeModel()
    if name == "flops":
        return FlopModel()
    raise ValueError(f"unknown cost model {name!r} (valid: {', '.join(COST_MODELS)})")
