"""Name -> object registries (heuristics, planners, zoo models)."""
from __future__ import annotations

from typing import Dict, Generic, List, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Objects registered by name, looked up with an error that lists the valid names.

    Args:
        what: what the objects are, for messages (``"heuristic"``).
        sort_names: list names sorted instead of in registration order.
    """

    def __init__(self, what: str, *, sort_names: bool = False):
        self.what = what
        self._sort = sort_names
        self._items: Dict[str, T] = {}

    def add(self, name: str, item: T, *, replace: bool = True) -> T:
        """Register ``item`` as ``name``; returns it.

        Raises:
            ValueError: ``name`` is taken and ``replace`` is false.
        """
        if not replace and name in self._items:
            raise ValueError(f"{self.what} {name!r} is already registered")
        self._items[name] = item
        return item

    def get(self, name: str) -> T:
        """The object registered as ``name``.

        Raises:
            ValueError: unknown name; the message lists the valid ones.
        """
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(f"unknown {self.what} {name!r} (valid: {', '.join(self.names())})") from None

    def names(self) -> List[str]:
        """The registered names (registration order, or sorted)."""
        return sorted(self._items) if self._sort else list(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items
