"""The runtime's limits: the tuning constants both per-op paths obey, in one place.

The Python reference reads them here (as module attributes, at the time of use:
tests lower ``COMPACT_MIN_OPS``); the native per-op path receives them from here
when it is configured (dtr/runtime/entry.py) and has no defaults of its own.
Each constant's rationale is in the Note it names.
"""
from __future__ import annotations

__all__ = ["MAX_VERSIONS", "GC_MIN_OPS", "COMPACT_MIN_OPS", "RECENT_OPS", "POLL_EVERY", "MAX_PREDICTIONS"]

#: In-place versions of a storage after which it is pinned (Note [Version chains] in reference.py).
MAX_VERSIONS = 8
#: Ops between two graph collections, at least (Note [Compaction] in driver.py).
GC_MIN_OPS = 256
#: Core ops below which a block never compacts its tables (Note [Compaction] in driver.py).
COMPACT_MIN_OPS = 4096
#: Ops whose tensors each op's partial poll looks at (Note [Liveness] in liveness.py).
RECENT_OPS = 4
#: Ops between two scheduled full polls, at least (Note [Liveness] in liveness.py).
POLL_EVERY = 16
#: Entries of the prediction cache before it starts over (Note [Sizes before allocation] in prediction.py).
MAX_PREDICTIONS = 1 << 16
