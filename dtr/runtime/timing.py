"""Measuring op times for ``cost_model="time"``: host wall time on CPU, CUDA events on CUDA."""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Deque, Dict, Hashable, List, Optional, Protocol, Tuple, Union

import torch

__all__ = ["WallTimer", "CudaEventTimer", "ProvisionalCosts", "make_timer", "MEASURE_FIRST", "RESAMPLE_EVERY"]


class WallTimer:
    """CPU (and any device without events): ``perf_counter_ns`` around the op; the cost is known at once."""

    pending: Tuple[()] = ()  # never anything in flight
    samples = False          # times every op: two clock reads are cheap

    @staticmethod
    def start() -> int:
        return time.perf_counter_ns()

    @staticmethod
    def stop(token: int) -> float:
        return float(time.perf_counter_ns() - token)

    def cancel(self, token: int) -> None:
        pass

    def poll(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def map_tags(self, fn: Callable[[Any], Any]) -> None:
        pass

    def defer(self, m: "_Pending", tag: Any) -> None:
        raise AssertionError("a wall-clock measurement is final at once: nothing to defer")


class _Pending:
    """One measurement in flight: the event pair and what the runtime wants told when it resolves."""

    __slots__ = ("start", "end", "host_ns", "tag")

    def __init__(self, start: Any, end: Any, host_ns: float):
        self.start = start
        self.end = end
        self.host_ns = host_ns
        self.tag: Any = None


def _cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


class _StreamRecorder:
    """``record(event)`` on the current CUDA stream, without ``torch.cuda.current_stream()``'s Python cost.

    The stream objects are cached by their raw handle (a cheap C call), so a
    change of stream (``torch.cuda.stream(s)``) is still followed.
    """

    __slots__ = ("_streams", "_raw", "_record")

    def __init__(self) -> None:
        self._streams: Dict[Tuple[int, int], Any] = {}
        self._raw = torch._C._cuda_getCurrentRawStream
        self._record = torch._C._CudaEventBase.record

    def __call__(self, event: Any) -> None:
        device = torch._C._cuda_getDevice()
        key = (device, self._raw(device))
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.current_stream(device)
        self._record(event, stream)


def _plain_record(event: Any) -> None:
    event.record()


# Note [Timing on CUDA]
# A CUDA op returns to the host once its kernels are queued, so a host clock
# around it measures the launch, not the work. Synchronizing after every op
# would measure the work but stall the host until the GPU drained its queue,
# every op: the host could never run ahead, which is what hides the runtime's
# per-op overhead. CudaEventTimer records a timing event on the current stream
# before and after the op and keeps the pair pending; at every later op the
# runtime polls the *oldest* pending pairs with ``end.query()`` (non-blocking)
# and each finished one is resolved with ``start.elapsed_time(end)``: the op's
# real cost reaches the core through ``Core.set_cost`` a few ops late. Until
# then the core works with a provisional cost (Note [Provisional costs]).
#
# The one synchronization: when more than ``max_pending`` measurements are
# still in flight after a poll, the oldest ones are waited for with
# ``end.synchronize()``. That happens only when the GPU is more than
# ``max_pending`` (64) ops behind the host, and it waits only for the oldest
# op, so the GPU keeps the rest of its queue and never idles; it bounds how
# stale the core's costs can be and how many events are in flight. The end of
# a ``dtr.budget`` block also waits for what is still pending (flush), once.
#
# What an event pair measures is the stream's time from the start event to
# the end event: the op's kernels, and, when the GPU was idle waiting for the
# host, the host's launch latency in between (what running the op again would
# take, too). Costs are whole nanoseconds, as on CPU (perf_counter_ns), so the
# core's cost sums stay exact. Events are pooled and reused (recording an
# event again overwrites it), so timing allocates nothing per op once warm.
# They are recorded on the current stream of the current device, looked up
# through the raw stream handle (``torch.cuda.Event.record()`` without a stream
# calls ``torch.cuda.current_stream()``, 30 us of Python per call: two calls
# per op were 0.11 s of a 0.49 s step of a 12-layer GPT on an H100). One CUDA
# device per budget is assumed (an event can only be recorded on the device
# it was first recorded on). Polling stops at the first pending pair not yet
# complete: with ops on one stream, later pairs cannot be complete either.
class CudaEventTimer:
    """Times ops with CUDA events, resolved lazily (see Note [Timing on CUDA]).

    Use: ``token = start()``, run the op, ``m = stop(token)``; ``m`` is the
    cost in ns (a float) when known now (``sync``), else a pending measurement
    to hand to :meth:`defer` with a tag once the op is accounted for. Then
    ``on_resolved(tag, ns)`` is called from :meth:`poll` or :meth:`flush` when
    the events have completed, oldest first; a tag of None is dropped.

    Args:
        on_resolved: ``f(tag, ns)``: a deferred measurement resolved.
        max_pending: measurements allowed in flight after a poll; beyond it
            the oldest are waited for (the only synchronization).
        sync: wait for each op's end event at once (exact costs at the op's
            end, one synchronization per op: used while recording a log).
        event_factory: makes a timing event (tests inject fakes); it needs
            ``record()``, ``query()``, ``synchronize()`` and
            ``elapsed_time(end)`` (ms), as ``torch.cuda.Event`` has.
    """

    samples = True  # see Note [Sampled timing on CUDA]

    def __init__(self, on_resolved: Callable[[Any, float], None], *, max_pending: int = 64, sync: bool = False,
                 event_factory: Optional[Callable[[], Any]] = None):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1 (got {max_pending})")
        self._on_resolved = on_resolved
        self.max_pending = max_pending
        self.sync = sync
        self._new_event = event_factory or _cuda_event
        self._record = _plain_record if event_factory is not None else _StreamRecorder()
        self._free: List[Any] = []
        self.pending: Deque[_Pending] = deque()
        self.forced_syncs = 0   # end.synchronize() calls forced by max_pending
        self.events_made = 0    # events created (the pool reuses them)

    def _event(self) -> Any:
        if self._free:
            return self._free.pop()
        self.events_made += 1
        return self._new_event()

    def start(self) -> Tuple[Any, int]:
        ev = self._event()
        self._record(ev)
        return ev, time.perf_counter_ns()

    def stop(self, token: Tuple[Any, int]) -> Union[float, _Pending]:
        start, t0 = token
        end = self._event()
        self._record(end)
        host_ns = float(time.perf_counter_ns() - t0)
        if self.sync:
            end.synchronize()
            return self._elapsed(start, end)
        return _Pending(start, end, host_ns)

    def cancel(self, token: Tuple[Any, int]) -> None:
        """The op failed: return its start event to the pool."""
        self._free.append(token[0])

    def defer(self, m: _Pending, tag: Any) -> None:
        m.tag = tag
        self.pending.append(m)

    def poll(self) -> None:
        """Resolve the oldest measurements that completed (non-blocking); enforce ``max_pending``."""
        q = self.pending
        while q and q[0].end.query():
            self._resolve(q.popleft())
        while len(q) > self.max_pending:
            m = q.popleft()
            m.end.synchronize()
            self.forced_syncs += 1
            self._resolve(m)

    def flush(self) -> None:
        """Wait for and resolve every pending measurement (the end of a block)."""
        q = self.pending
        while q:
            m = q.popleft()
            m.end.synchronize()
            self._resolve(m)

    def map_tags(self, fn: Callable[[Any], Any]) -> None:
        """Replace each pending tag t by ``fn(t)`` (None: drop its result), e.g. after core compaction."""
        for m in self.pending:
            if m.tag is not None:
                m.tag = fn(m.tag)

    def _resolve(self, m: _Pending) -> None:
        ns = self._elapsed(m.start, m.end)
        if m.tag is not None:
            self._on_resolved(m.tag, ns)

    def _elapsed(self, start: Any, end: Any) -> float:
        ns = float(max(0, round(start.elapsed_time(end) * 1e6)))  # ms -> whole ns
        self._free.append(start)
        self._free.append(end)
        return ns


class Timer(Protocol):
    """What the runtime asks of a timer (:class:`WallTimer` or :class:`CudaEventTimer`)."""

    pending: Any   # measurements in flight (falsy when none)
    samples: bool  # whether it times only some runs of an op (Note [Sampled timing on CUDA])

    def start(self) -> Any: ...
    def stop(self, token: Any) -> Union[float, "_Pending"]: ...
    def cancel(self, token: Any) -> None: ...
    def defer(self, m: "_Pending", tag: Any) -> None: ...
    def poll(self) -> None: ...
    def flush(self) -> None: ...
    def map_tags(self, fn: Callable[[Any], Any]) -> None: ...


def make_timer(device: Optional[torch.device], on_resolved: Callable[[Any, float], None], *,
               sync: bool = False) -> Timer:
    """The timer for ops on ``device``: CUDA events on CUDA, host wall time elsewhere."""
    if device is not None and device.type == "cuda":
        return CudaEventTimer(on_resolved, sync=sync)
    return WallTimer()


MEASURE_FIRST = 2     # see Note [Sampled timing on CUDA]
RESAMPLE_EVERY = 16


# Note [Provisional costs]
# The core needs an op's cost when the op ends (its clock, its storages'
# costs). While the event pair is in flight, the runtime gives it an estimate:
# the last measured time of the same op on the same argument shapes (the key
# of the output-size cache), else the mean measured time of the same operator
# overload, else the host time of the call (what the CPU path measures).
# A training loop repeats its ops with the same shapes, so from its second
# step every estimate is the op's time one step ago, usually within noise of
# the real one; in the first step, same-overload means (earlier layers) beat
# the host time, which is a launch time. The alternative of converting the
# flop model's estimate at a measured flop rate was rejected: the rate differs
# by orders of magnitude between matrix products and memory-bound ops, and the
# flop formulas would cost more host time per op than the lookup. The estimate
# is replaced by the real cost (Core.set_cost) as soon as the events resolve;
# what the estimate already advanced (the core's clock, i.e. staleness, and
# any recomputation counted meanwhile) is not rewritten.
class ProvisionalCosts:
    """Estimates of op times not measured yet (see Note [Provisional costs])."""

    def __init__(self) -> None:
        self._by_key: Dict[Hashable, float] = {}
        self._by_func: Dict[Any, List[float]] = {}  # func -> [sum of ns, count]
        self._runs: Dict[Hashable, int] = {}

    # Note [Sampled timing on CUDA]
    # Recording, polling and resolving two events per op is host work, and on a
    # GPU the host is what keeps ahead of the device. On a 12-layer GPT on an H100
    # (1815 ops, 0.26 s plain; benchmarks/bench_tracking_cuda.py), budget(None)
    # took 1.64x plain with every op timed and 1.33x with flop estimates, while a
    # do-nothing dispatch mode took 1.00x. Sampling alone made it 1.34x; with the
    # tracking-only polls of Note [Liveness] (dtr/runtime/liveness.py), 1.30x.
    # A training step repeats its ops with the same shapes (layer after layer, step
    # after step), so the event timer samples: the first MEASURE_FIRST times an op
    # key (op and argument shapes) runs in a block it is timed, then one run in
    # RESAMPLE_EVERY (to follow clocks and contention); the others run untimed and
    # take the key's last measured time, which is final at the op's end (no
    # set_cost). A key whose measurement has not resolved yet is timed again. The
    # CPU timer (two clock reads) always times. Recomputations are always timed:
    # they make remat_seconds.
    def sampled(self, key: Hashable) -> Optional[float]:
        """Count a run of ``key``: its last measured time when this run need not be timed, else None.

        See Note [Sampled timing on CUDA]. O(1).
        """
        n = self._runs.get(key, 0) + 1
        self._runs[key] = n
        if n <= MEASURE_FIRST or n % RESAMPLE_EVERY == 0:
            return None
        return self._by_key.get(key)

    def guess(self, key: Hashable, func: Any, host_ns: float) -> float:
        """Whole ns: the last time of ``key``, else the mean of ``func``, else ``host_ns``."""
        ns = self._by_key.get(key)
        if ns is not None:
            return ns
        s = self._by_func.get(func)
        if s is not None:
            return float(round(s[0] / s[1]))
        return float(round(host_ns))

    def observe(self, key: Hashable, func: Any, ns: float) -> None:
        """A measured time of ``func`` on the arguments ``key`` describes."""
        self._by_key[key] = ns
        s = self._by_func.get(func)
        if s is None:
            self._by_func[func] = [ns, 1]
        else:
            s[0] += ns
            s[1] += 1
