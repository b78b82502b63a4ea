"""Writing what the runtime did as a v1 log (the format: README.md, "Log format v1").

Every core call the runtime makes becomes one line, so replaying the log in
``dtr-sim replay`` with the same budget and heuristic makes the same decisions
(exactly so with ``cost_model="flops"``, whose costs do not depend on timing).
"""
from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Mapping
from typing import Sequence

import torch

__all__ = ["LogRecorder", "OWN_META", "check_meta"]

#: The meta line's fields the recorder writes itself: extra fields may not set them.
OWN_META = ("op", "version", "torch")


def check_meta(meta: object, reserved: Sequence[str] = ()) -> dict:
    """Extra fields for the log's meta line (``dtr.budget``'s ``log_meta``), checked: what the reader will take.

    Args:
        meta: a mapping of field names to JSON values, or None (no fields).
        reserved: fields the caller writes itself, besides :data:`OWN_META`.

    Returns:
        The fields, as a new dict.

    Raises:
        TypeError: ``meta`` is not a mapping, a key is not a string, or a value is not JSON.
        ValueError: a key the log writes itself, or a number that is not finite (NaN, infinity).
    """
    if meta is None:
        return {}
    if not isinstance(meta, Mapping):
        raise TypeError(f"log_meta must be a dict of extra fields for the log's meta line (e.g. "
                        f"{{'model': 'gpt'}}), not {type(meta).__name__}")
    own = (*OWN_META, *reserved)
    for key, value in meta.items():
        if not isinstance(key, str):
            raise TypeError(f"log_meta's keys must be strings (the meta line's field names), not {key!r}")
        if key in own:
            raise ValueError(f"log_meta[{key!r}]: the log writes {key!r} itself; use another name (the meta "
                             f"line's own fields: {', '.join(own)})")
        try:
            json.dumps(value, allow_nan=False)
        except TypeError as e:
            raise TypeError(f"log_meta must hold JSON values only (it becomes the log's meta line): "
                            f"log_meta[{key!r}]: {e}") from None
        except ValueError as e:  # NaN or an infinity (JSON has none), or a circular reference
            raise ValueError(f"log_meta[{key!r}] cannot be written as JSON ({e}): its numbers must be finite, "
                             f"as the log's reader requires") from None
        why = _beyond_reader(value, 2)
        if why:
            raise ValueError(f"log_meta[{key!r}]: {why}, which the log's reader refuses")
    return dict(meta)


# What the log reader (csrc/log_json.h) refuses beyond JSON itself: deeper nesting than this, and strings
# that are not valid UTF-8 (a lone surrogate).
_MAX_DEPTH = 64


def _beyond_reader(value: object, depth: int) -> str:
    """Why the reader would refuse ``value`` at nesting ``depth`` (the meta line's object is 1); "" if not."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"the string {value[:20]!r} is not valid UTF-8 (a lone surrogate)"
        return ""
    if isinstance(value, (list, tuple, dict)):
        if depth > _MAX_DEPTH:
            return f"it nests lists and objects more than {_MAX_DEPTH} deep"
        items = list(value.items()) if isinstance(value, dict) else [(None, v) for v in value]
        for k, v in items:
            why = _beyond_reader(k, depth) if k is not None else ""
            why = why or _beyond_reader(v, depth + 1)
            if why:
                return why
    return ""


def _id(handle: int) -> str:
    """A log's name for a runtime handle (driver.py's Note [Handles])."""
    return f"t{handle}"


class LogRecorder:
    """Append v1 lines to a file (``.gz`` compressed by name).

    Args:
        path: where to write.
        meta: extra fields for the ``meta`` line (the cost unit among them).
    """

    def __init__(self, path: str | os.PathLike, meta: dict):
        meta = check_meta(meta)  # before the file is opened: a meta line the reader refuses is never written
        path = os.fspath(path)
        raw = gzip.open(path, "wt") if path.endswith(".gz") else open(path, "w")
        self._f: io.TextIOBase = raw
        self._dump = json.JSONEncoder(separators=(", ", ": ")).encode
        info = {"op": "meta", "version": 1, "torch": torch.__version__}
        info.update(meta)
        self._write(info)

    def _write(self, obj: dict) -> None:
        self._f.write(self._dump(obj))
        self._f.write("\n")

    def constant(self, handle: int, size: int) -> None:
        self._write({"op": "constant", "id": _id(handle), "size": size})

    def call(self, name: str, inputs: Sequence[int], outputs: Sequence[int], sizes: Sequence[int],
             cost: float, mutated: Sequence[int] = ()) -> None:
        """An op; ``mutated`` lists inputs it also writes in place (an extension of v1)."""
        line = {"op": "call", "name": name, "inputs": [_id(h) for h in inputs],
                "outputs": [_id(h) for h in outputs], "sizes": list(sizes), "aliases": [None] * len(outputs),
                "cost": cost}
        if mutated:
            line["mutated"] = [_id(h) for h in mutated]
        self._write(line)

    def pin(self, handle: int) -> None:
        """The handle's tensor becomes a constant (an extension of v1)."""
        self._write({"op": "pin", "id": _id(handle)})

    def read(self, handle: int) -> None:
        """The handle's tensor is read outside the dispatcher: brought back, not pinned (an extension of v1)."""
        self._write({"op": "read", "id": _id(handle)})

    def protect(self, handle: int) -> None:
        """A dropped constant is about to be freed (an extension of v1)."""
        self._write({"op": "protect", "id": _id(handle)})

    def collect(self) -> None:
        """The graph GC ran: storages nothing can need again were freed (an extension of v1)."""
        self._write({"op": "collect"})

    def release(self, handle: int) -> None:
        self._write({"op": "release", "id": _id(handle)})

    def close(self) -> None:
        self._f.close()
