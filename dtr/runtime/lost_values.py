"""Tensors the end of a block could not bring back: each tried on its own, the rest filled (driver.py's Note
[The end of a block])."""
from __future__ import annotations

import math
import warnings

from dtr.core import Core, Hold
from dtr.errors import BudgetWarning
from dtr.runtime.storage_table import StorageTable, resize_storage

__all__ = ["bring_back_each", "fill_lost"]


def bring_back_each(core: Core, table: StorageTable) -> None:
    """After the bring-back failed twice: each held tensor on its own, limits lifted, so that only those whose
    recomputation fails lose their values."""
    core.set_budget(None)
    core.set_thrash_limit(math.inf)
    for t in list(table.alive.values()):
        try:
            core.pin_many([t], Hold.OUTPUT)
        except KeyboardInterrupt:  # (interrupted again: the rest are filled)
            break
        except Exception:
            continue


def fill_lost(core: Core, table: StorageTable, why: str) -> None:
    """Give each storage the program holds that is still without its bytes 0xFF bytes, and warn."""
    lost = nbytes = 0
    for t in table.alive.values():
        s = core.storage_of(t)
        buf = table.phys.get(s)
        st = buf.get() if buf is not None else None
        n = core.storage_size(s)
        if st is not None and st.nbytes() < n:
            resize_storage(st, n)
            st.fill_(255)  # type: ignore[attr-defined]  # (UntypedStorage.fill_ fills bytes)
            lost, nbytes = lost + 1, nbytes + n
    if lost:
        warnings.warn(f"dtr: bringing back the tensors the program holds at the end of the block failed ({why}): "
                      f"{lost} storage(s), {nbytes} bytes, lost their values and hold 0xFF bytes (NaN for floating "
                      f"dtypes); recompute them outside the block", BudgetWarning, stacklevel=4)
