"""The rules a core runs under that differ between dtr's runtime and simrd: one frozen value.

The runtime (``dtr.budget``) and the simulator (``dtr-sim``) drive the same
core. Where the DTR paper's simulator (simrd) and a real PyTorch program
differ, the core has a switch; :class:`Semantics` holds all of them, is what a
log's meta line records (so a replay reproduces what its recorder did), and is
what :func:`dtr.core.make_config` hands to the core. The thrash limit, a
separate knob with the same owner problem, is checked and converted here too.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

from dtr import _C

__all__ = ["Semantics", "SIMRD", "RUNTIME", "check_thrash_limit", "remat_allowance", "remat_count_allowance"]


_FIELD_NAMES: Dict[type, Tuple[str, ...]] = {}


def _field_names(cls: type) -> Tuple[str, ...]:
    """A dataclass's field names, in order (once per class: a budget asks for them at every block)."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


@dataclass(frozen=True)
class Semantics:
    """How the core treats constants, releases, eqclass components, in-place writes and recomputation order.

    Every field is False in simrd's semantics (:data:`SIMRD`) and True in the
    runtime's (:data:`RUNTIME`). The field names are the meta-line keys of a log.

    Attributes:
        free_dead_constants: free a constant whose last reference dies (a
            program's tensor is freed when it dies) instead of keeping it
            resident to the end (simrd's).
        keep_needed: on its last release, keep a storage resident while an
            evicted, referenced storage depends on it, and free rematerialized
            unreferenced storages once their dependents are back (the core's
            Note [Freeing what an evicted tensor needs]).
        eqclass_split: split eqclass components exactly when a member leaves
            (the core's Note [Splitting eqclass components]), even if the
            heuristic's own ``split`` is not set.
        inplace_handover: a recomputed in-place write takes over the bytes of
            an old version nothing else can read (the core's Note [Handing
            bytes over on recomputation]).
        deep_first: recompute first the evicted inputs whose recomputation
            recurses, so that less is held meanwhile (the core's Note [Deepest
            input first]); simrd's order is the inputs' own.
    """

    free_dead_constants: bool = False
    keep_needed: bool = False
    eqclass_split: bool = False
    inplace_handover: bool = False
    deep_first: bool = False

    @classmethod
    def fields(cls) -> Tuple[str, ...]:
        """The field names, which are also the log meta-line keys, in order."""
        return _field_names(cls)

    def __post_init__(self) -> None:
        for name in self.fields():
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Semantics.{name} must be True or False, not {getattr(self, name)!r}")

    @classmethod
    def from_meta(cls, meta: Mapping) -> "Semantics":
        """The semantics a log's meta line records (a missing field is simrd's, False).

        Raises:
            ValueError: a field holds something other than true or false; the
                message names the field and the value.
        """
        values = {}
        for name in cls.fields():
            value = meta.get(name, False)
            if not isinstance(value, bool):
                raise ValueError(f"meta field '{name}' must be true or false (got {value!r})")
            values[name] = value
        return cls(**values)

    def to_meta(self) -> dict:
        """The meta-line fields that record these semantics (every field, true or false)."""
        return {name: getattr(self, name) for name in self.fields()}

    def replace(self, **changes: Optional[bool]) -> "Semantics":
        """A copy with the given fields changed; a field given as None keeps its value.

        Raises:
            TypeError: an unknown field name, or a value that is not a bool.
        """
        unknown = sorted(set(changes) - set(self.fields()))
        if unknown:
            raise TypeError(f"unknown semantics field(s) {', '.join(unknown)} (valid: {', '.join(self.fields())})")
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


#: The DTR paper's simulator: every switch off. Hand-written and simrd's logs replay under it.
SIMRD = Semantics()
#: A real PyTorch program under ``dtr.budget``: every switch on (``eqclass_split`` may be turned off).
RUNTIME = Semantics(free_dead_constants=True, keep_needed=True, eqclass_split=True, inplace_handover=True,
                    deep_first=True)


# Note [The thrash limit]
# A thrash limit X stops a run once recomputation passes (X - 1) times the
# compute it is measured against, or once the number of recomputations passes
# (X - 1) times the number of ops computed (ops that cost nothing, such as
# views, could otherwise be recomputed for ever: the core's Note [Counting
# recomputations]). The base is the whole log's for a replay, the block's own
# first computations so far for the runtime. X = 1 allows no recomputation at
# all; infinity (or None) never stops. Both drivers check X here and hand it
# to the core, which applies it (remat_allowance, remat_count_allowance).

def check_thrash_limit(value: object) -> float:
    """A thrash limit as a float: a number >= 1, or None or infinity for no limit (returned as ``math.inf``).

    Raises:
        ValueError: anything else; the message says what a thrash limit is.
    """
    if value is None:
        return math.inf
    limit = math.nan
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            limit = float(value)
        except OverflowError:  # (an int past a float's range: larger than any finite limit, or below -1)
            limit = -math.inf if operator.lt(value, 0) else math.inf
    if not limit >= 1:
        raise ValueError(f"the thrash limit must be a number >= 1 (total compute allowed, as a multiple of the "
                         f"program's own) or None for no limit, not {value!r}")
    return limit


def remat_allowance(thrash_limit: float, base: float) -> float:
    """The recomputation a thrash limit allows over ``base`` compute: ``(thrash_limit - 1) * base``.

    An infinite limit, or a ``base`` of 0 (nothing has cost anything yet, so
    nothing recomputed can cost anything either), allows any. Never smaller for
    a larger ``base``. The rule is written once, in the core (csrc/core.h), which
    the native per-op path asks directly.
    """
    return _C.remat_allowance(float(thrash_limit), float(base))


def remat_count_allowance(thrash_limit: float, base_ops: int) -> int:
    """The recomputations a thrash limit allows over ``base_ops`` ops computed: ``(thrash_limit - 1) * base_ops``,
    rounded down (2**63 - 1 for an infinite limit). Never smaller for a larger base; the core owns the rule."""
    return _C.remat_count_allowance(float(thrash_limit), int(base_ops))
