"""Reading operator logs (format v1 and the original simrd format), gzip or not.

The format is detected from the content, never from the file name. Parsing is
done by the C++ reader (see Note [Why the log reader is in C++] in
csrc/logparse.cpp); this module adds file handling, error reporting with the
file name, and typed records for tools that walk a log in Python.
"""
from __future__ import annotations

import gzip
import json
import os
import stat
import zlib
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Optional, Tuple

from dtr.core import InstrKind, Program, RawLogError, parse_program
from dtr.errors import LogFormatError
from dtr.semantics import SIMRD, Semantics

__all__ = ["Log", "Record", "read_log", "read_bytes", "parse_text", "KINDS"]

#: A Record's kinds, indexed by InstrKind: "constant", "call", "mutate", "copy", "copyfrom",
#: "release", "pin", "protect", "collect", "read".
KINDS = tuple(InstrKind(k).name.lower() for k in range(len(InstrKind)))


class Record(NamedTuple):
    """One instruction of a parsed log, over the log's own string ids.

    ``kind`` is one of :data:`KINDS`. For ``call``: ``outputs = name(inputs)``,
    ``sizes[i]`` bytes per output and ``aliases[i]`` the input id output i views
    (None when it owns a new storage). For ``mutate``: ``mutated`` lists the
    input ids written; ``inplace`` tells a true in-place write (the core's
    ``mutate_inplace``) from simrd's copy. A ``call`` with ``mutated`` also
    writes those inputs in place (``inplace`` is then True). ``copy``/``copyfrom``:
    ``outputs[0] = inputs[0]``. ``release``/``constant``/``pin``/``protect``: the
    id is ``inputs[0]`` / ``outputs[0]``.
    """

    kind: str
    line: int
    name: Optional[str]
    cost: float
    inputs: Tuple[str, ...]
    outputs: Tuple[str, ...]
    sizes: Tuple[int, ...]
    aliases: Tuple[Optional[str], ...]
    mutated: Tuple[str, ...]
    inplace: bool = False


@dataclass(frozen=True)
class Log:
    """A parsed log.

    Attributes:
        path: where it was read from.
        program: the core's parsed form (replayed without leaving C++).
        format: ``"v1"`` or ``"simrd"``.
        cost_unit: unit of the costs (``ns`` unless the v1 meta line says otherwise).
        meta: the v1 meta line (empty for simrd logs).
        semantics: the rules its recorder ran under, from the meta line
            (:data:`dtr.semantics.SIMRD` when it says nothing: simrd's and
            hand-written logs). Replaying under them is what makes a replay
            reproduce the runtime's decisions.
    """

    path: str
    program: Program
    format: str
    cost_unit: str
    meta: dict
    semantics: Semantics = SIMRD

    def __len__(self) -> int:
        return len(self.program)

    @property
    def base_compute(self) -> float:
        """Total cost of the log's operators (calls and mutations)."""
        return self.program.base_compute()

    def records(self) -> Iterator[Record]:
        """The instructions as typed :class:`Record` s, in order."""
        ids = self.program.handle_names
        names = self.program.names
        for kind, line, name, cost, ins, outs, sizes, aliases, mutated, inplace in self.program.records():
            in_ids = tuple(ids[h] for h in ins)
            yield Record(
                kind=KINDS[kind], line=line, name=names[name] if name >= 0 else None, cost=cost,
                inputs=in_ids, outputs=tuple(ids[h] for h in outs), sizes=tuple(sizes),
                aliases=tuple(in_ids[a] if a >= 0 else None for a in aliases),
                mutated=tuple(in_ids[j] for j in mutated), inplace=bool(inplace))


#: What a path that is neither a file nor a pipe is, by its stat type.
_NOT_A_FILE = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def not_a_file(f) -> Optional[str]:
    """What the open file ``f`` is when it is neither a regular file nor a pipe ("a character device", ...).

    The files dtr-sim reads whole (logs, sweep CSVs, plan files) are refused when
    this is not None, before anything is read: a device such as ``/dev/zero``
    never ends. None for a regular file or a pipe.
    """
    mode = os.fstat(f.fileno()).st_mode
    return next((what for test, what in _NOT_A_FILE if test(mode)), None)


def read_bytes(path: str | os.PathLike) -> bytes:
    """The decompressed bytes of a log file (gzip detected by its magic number).

    A log is a regular file or a pipe (``<(zcat log.gz)``); a device such as
    ``/dev/zero`` or ``/dev/tty`` is refused before anything is read from it.

    Args:
        path: the log's path.

    Returns:
        The bytes of the log, decompressed if it is gzip.

    Raises:
        LogFormatError: the file is missing, unreadable, not a file or a pipe,
            a corrupt gzip file, or too large to hold in memory.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            kind = not_a_file(f)
            if kind is not None:
                raise LogFormatError(path, 0, f"not a log file: this is {kind}; give a log file (or a pipe)")
            data = f.read()
    except OSError as e:
        raise LogFormatError(path, 0, f"cannot read the log: {e.strerror or e}") from None
    except MemoryError:
        raise _too_large(path, "reading it") from None
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise LogFormatError(path, 0, f"corrupt gzip file: {e}") from None
        except MemoryError:
            raise _too_large(path, f"decompressing its {len(data)} bytes") from None
    return data


def _too_large(path: str, doing: str) -> LogFormatError:
    """The error for a log that ran out of memory while ``doing`` (a sentence's middle)."""
    return LogFormatError(path, 0, f"the log does not fit in memory (out of memory {doing}): is it the log "
                                   f"you meant? Replay a smaller one, or on a machine with more memory")


def read_log(path: str | os.PathLike) -> Log:
    """Read and validate a log.

    Args:
        path: a v1 or simrd log, optionally gzip-compressed, any file name.

    Returns:
        The parsed :class:`Log`.

    Raises:
        LogFormatError: names the file, the line and what is wrong with it.
    """
    path = os.fspath(path)
    data = read_bytes(path)
    return _parse(data, path)


def parse_text(text: str, path: str = "<string>") -> Log:
    """Parse a log held in a string (tests, generated logs)."""
    return _parse(text.encode("utf-8", "surrogatepass"), path)


def _parse(data: bytes, path: str) -> Log:
    try:
        program = parse_program(data)
    except RawLogError as e:
        line, reason = e.args
        raise LogFormatError(path, line, reason) from None
    except MemoryError:
        raise _too_large(path, f"parsing its {len(data)} bytes") from None
    meta: dict = {}
    semantics = SIMRD
    if program.meta_json:
        try:
            meta = json.loads(program.meta_json)
        except ValueError as e:  # the C++ reader accepted it; this guards against the two disagreeing
            raise LogFormatError(path, program.meta_line, f"the meta line is not valid JSON: {e}") from None
        try:  # a semantics field other than true/false must not be read as one
            semantics = Semantics.from_meta(meta)
        except ValueError as e:
            raise LogFormatError(path, program.meta_line, str(e)) from None
    return Log(path=path, program=program, format=program.format, cost_unit=program.cost_unit, meta=meta,
               semantics=semantics)

