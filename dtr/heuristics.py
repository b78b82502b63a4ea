"""The eviction heuristics, registered by name.

Every heuristic is a point in simrd's parametric family
``h(S) = c(S) / (m(S) * stale(S))`` (simrd section 4.3): which cost term ``c``
it uses (``full`` = exact evicted neighbourhood e*, ``eqclass`` = union-find
evicted components, ``local`` = cost(S) alone, ``none`` = 1), and whether the
size ``m`` and the staleness terms are used. ``eqclass-split`` is ``eqclass``
whose components split exactly when a member is recomputed (simrd's never
split; ``dtr.budget`` splits them for ``eqclass`` too, by default). ``random``
ignores scores. The C++ core evaluates the formula; a heuristic here is only
its parameters, so adding one is one small decorated class.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from dtr.registry import Registry

__all__ = ["Heuristic", "register_heuristic", "get_heuristic", "heuristic_names", "COST_MODES"]

COST_MODES = ("full", "eqclass", "local", "none")


@dataclass(frozen=True)
class Heuristic:
    """Parameters of one eviction heuristic.

    Attributes:
        name: the registered name.
        cost: ``full``, ``eqclass``, ``local`` or ``none``.
        use_size: divide by the storage's size.
        use_staleness: divide by the time since its last access.
        random: choose uniformly from the pool (seeded) instead.
        split: with ``cost="eqclass"``, split a component exactly when a member
            leaves it (the core's Note [Splitting eqclass components]) instead
            of only subtracting the member's cost, as simrd does.
    """

    name: str
    cost: str = "eqclass"
    use_size: bool = True
    use_staleness: bool = True
    random: bool = False
    split: bool = False

    def ablate(self, *, cost: str | None = None, size: bool | None = None,
               staleness: bool | None = None) -> "Heuristic":
        """Return a copy with ablation switches applied (``None`` keeps a setting)."""
        if cost is not None and cost not in COST_MODES:
            raise ValueError(f"unknown cost term {cost!r} (valid: {', '.join(COST_MODES)})")
        h = replace(self,
                    cost=self.cost if cost is None else cost,
                    use_size=self.use_size if size is None else size,
                    use_staleness=self.use_staleness if staleness is None else staleness)
        if h != self:
            parts = [h.cost, "size" if h.use_size else "nosize", "stale" if h.use_staleness else "nostale"]
            h = replace(h, name=f"{self.name}[{','.join(parts)}]")
        return h


_REGISTRY: Registry[Heuristic] = Registry("heuristic")


def register_heuristic(name: str) -> Callable[[type], type]:
    """Class decorator: register a heuristic whose class attributes give its parameters."""

    def wrap(cls: type) -> type:
        fields = {k: getattr(cls, k) for k in ("cost", "use_size", "use_staleness", "random", "split")
                  if hasattr(cls, k)}
        if fields.get("cost", "eqclass") not in COST_MODES:
            raise ValueError(f"heuristic {name!r}: unknown cost term {fields['cost']!r}")
        _REGISTRY.add(name, Heuristic(name=name, **fields))
        return cls

    return wrap


def get_heuristic(name: str) -> Heuristic:
    """Look a heuristic up by name.

    Raises:
        ValueError: unknown name; the message lists the valid ones.
    """
    return _REGISTRY.get(name)


def heuristic_names() -> list:
    """The registered heuristic names, in registration order."""
    return _REGISTRY.names()


@register_heuristic("dtr")
class DTRFull:
    """DTR-Full: cost of S plus its exact evicted neighbourhood e*(S)."""
    cost = "full"


@register_heuristic("eqclass")
class DTREqClass:
    """DTR-EqClass: cost of S plus the union-find evicted components next to S."""
    cost = "eqclass"


@register_heuristic("local")
class DTRLocal:
    """DTR-Local: cost of S alone."""
    cost = "local"


@register_heuristic("lru")
class LRU:
    """Least recently used: 1 / staleness."""
    cost = "none"
    use_size = False


@register_heuristic("largest")
class Largest:
    """Largest first: 1 / size."""
    cost = "none"
    use_staleness = False


@register_heuristic("random")
class Random:
    """A uniformly random evictable storage (seeded)."""
    cost = "none"
    random = True


@register_heuristic("eqclass-split")
class DTREqClassSplit:
    """DTR-EqClass with exact components: a component splits when a member leaves it.

    simrd's eqclass only subtracts a rematerialized storage's cost from its
    component, so evicted storages on both sides of it keep counting each
    other; here the component splits into the exact connected components of
    what stays evicted (the core's Note [Splitting eqclass components]).
    """
    cost = "eqclass"
    split = True
