"""Tensor methods that hand a tensor's memory out of PyTorch's view.

# Note [Escaped memory]
# ``.numpy()``, ``__array__``, ``data_ptr()`` and DLPack export give the
# program the raw buffer; dtr could not refill it behind a NumPy array's back,
# so inside a budget these methods first bring the storage back and pin it
# (it is never evicted again). ``.tolist()`` and friends copy the data out:
# they only bring it back. None of them go through the dispatcher, so they
# are wrapped while a budget is active and restored when it exits.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, List

import torch

__all__ = ["patch_escapes"]

# method name -> whether the memory escapes (pin) or is only read (bring back)
ESCAPING: Dict[str, bool] = {
    "numpy": True,
    "__array__": True,
    "data_ptr": True,
    "__dlpack__": True,
    "tolist": False,
}


def patch_escapes(escape: Callable[[torch.Tensor, bool], None]) -> Callable[[], None]:
    """Wrap the escaping tensor methods to call ``escape(tensor, pin)`` first.

    Returns:
        A function that restores the original methods.
    """
    saved: List = []
    for name, pin in ESCAPING.items():
        original = getattr(torch.Tensor, name, None)
        if original is None:
            continue

        def wrapper(self, *args, __original=original, __pin=pin, **kwargs):
            escape(self, __pin)
            return __original(self, *args, **kwargs)

        functools.update_wrapper(wrapper, original)
        saved.append((name, original))
        setattr(torch.Tensor, name, wrapper)

    def restore() -> None:
        for name, original in saved:
            setattr(torch.Tensor, name, original)

    return restore
