"""The arguments of ``dtr.budget`` that name amounts and places: the limit in bytes, and the device."""
from __future__ import annotations

from typing import Optional, Union

import torch

from dtr.units import parse_bytes

__all__ = ["check_device", "limit_bytes"]


def limit_bytes(limit: Union[None, int, float, str]) -> Optional[int]:
    """The budget in bytes, or None for no limit: a number of 2**63 bytes or more (``float("inf")``) is none.

    Raises:
        BudgetError: ``limit`` is not a size (a string past 2**63 - 1 bytes says so).
    """
    if limit is None or (isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit >= 2 ** 63):
        return None
    return parse_bytes(limit)


def check_device(device: Union[None, str, torch.device]) -> Optional[torch.device]:
    """``device`` as a torch.device, checked to exist in this torch (without initializing it).

    Raises:
        ValueError: not a device, or a device this torch cannot use; the message says which.
    """
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a device: {e}") from None
    if dev.type not in ("cpu", "meta"):
        module = getattr(torch, dev.type, None)
        available = getattr(module, "is_available", None)
        if available is not None and not available():
            raise ValueError(f"device {device!r} is not available in this process (torch {torch.__version__} "
                             f"sees no {dev.type} device); use device='cpu', or leave device=None to budget the "
                             f"device of the first tensor the block touches")
    return dev
