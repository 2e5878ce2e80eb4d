"""A rank's busy time per step from the device's own clock (``hspmd_elastic.elastic.device_timer``).

The CUDA timer runs here against a double with CUDA events' semantics (``FakeStream``,
``FakeEvent``): an event completes when the stream reaches it, ``elapsed_time`` needs both events
complete (torch raises otherwise), and any synchronisation fails the test. The waits are real
``Comm.wait`` calls, with a waiter that puts the operation on the stream as NCCL's ``wait()``
does. The ``gpu``-marked case runs the same against real ``torch.cuda.Event``s on a GPU machine
(``pytest -m gpu tests/test_device_timer.py``) and skips, with the reason, elsewhere.
"""

from __future__ import annotations

import threading
from collections import deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd_elastic.elastic.busy import BusyMeter
from hspmd_elastic.elastic.device_timer import (CudaEventTimer, HostTimer, StepBusy,
                                                step_timer)
from hspmd_elastic.graph.comm import Comm, waiting

pytestmark = pytest.mark.timeout(120)

NO_CUDA = None if torch.cuda.is_available() else \
    f"torch {torch.__version__} cannot use CUDA (a CPU-only build, or no GPU)"


class FakeStream:
    """A stream's queue: kernels (milliseconds) and event records, run in order by ``run``."""

    def __init__(self):
        self.ops: deque = deque()
        self.now_ms = 0.0
        self.recorded = 0  # event records enqueued, ever

    def kernel(self, ms: float) -> None:
        self.ops.append(ms)

    def run(self, ops: int | None = None) -> None:
        """Let the stream reach the next ``ops`` entries (all by default)."""
        for _ in range(len(self.ops) if ops is None else min(ops, len(self.ops))):
            op = self.ops.popleft()
            if isinstance(op, tuple):
                event, generation = op
                if generation == event.generation:
                    event.at_ms = self.now_ms
            else:
                self.now_ms += op


class FakeEvent:
    """``torch.cuda.Event(enable_timing=True)``'s semantics, on a ``FakeStream``."""

    def __init__(self, stream: FakeStream):
        self.stream, self.generation, self.at_ms = stream, 0, None
        self.recorded, self.queries = False, 0

    def record(self) -> None:
        self.generation += 1
        self.recorded, self.at_ms = True, None
        self.stream.ops.append((self, self.generation))
        self.stream.recorded += 1

    def query(self) -> bool:
        self.queries += 1
        return not self.recorded or self.at_ms is not None

    def elapsed_time(self, end: "FakeEvent") -> float:
        if self.at_ms is None or end.at_ms is None:
            raise RuntimeError("CUDA error: device not ready")
        return end.at_ms - self.at_ms

    def synchronize(self) -> None:
        raise AssertionError("the timer synchronised on an event")

    def wait(self, stream=None) -> None:
        raise AssertionError("the timer made a stream wait on an event")


def _setup(**kw):
    stream = FakeStream()
    events: list[FakeEvent] = []

    def factory():
        events.append(FakeEvent(stream))
        return events[-1]

    # the operation occupies the stream between the waits' brackets (NCCL's wait() orders the
    # current stream after it); ``work`` is its duration on the stream
    comm = Comm({}, 0, lambda work, what: stream.kernel(work))
    return CudaEventTimer(factory, **kw), comm, stream, events


def _step(timer, comm, stream, version, segments, last_ms):
    """One step: for each (compute, wait) a kernel then a wait; then a last kernel."""
    with timer.step(version, comm):
        for compute_ms, wait_ms in segments:
            stream.kernel(compute_ms)
            comm.wait(wait_ms, "all_reduce")
        stream.kernel(last_ms)


@pytest.fixture(autouse=True)
def _no_device_sync(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("torch.cuda.synchronize called on the hot path")
    monkeypatch.setattr(torch.cuda, "synchronize", refuse)


def test_cuda_busy_is_the_compute_segments_read_back_a_step_later():
    timer, comm, stream, events = _setup()
    _step(timer, comm, stream, 1, [(3.0, 10.0)], 2.0)
    stream.run()  # complete, but not looked at before the next step ends
    assert timer.finished() == [] and sum(e.queries for e in events) == 0
    _step(timer, comm, stream, 1, [(4.0, 1.0), (1.0, 50.0)], 3.0)
    assert timer.finished() == [StepBusy(1, pytest.approx(0.005))]  # 3 + 2 ms; the 10 left out
    stream.run()
    _step(timer, comm, stream, 2, [], 1.0)
    assert timer.finished() == [StepBusy(1, pytest.approx(0.008))]
    assert comm.waited_s > 0  # the host's count goes on as before
    assert timer.pending == 1 and timer.dropped == 0


def test_a_step_not_reached_yet_stays_pending_and_comes_later_in_order():
    timer, comm, stream, _events = _setup()
    _step(timer, comm, stream, 1, [(1.0, 5.0)], 1.0)
    _step(timer, comm, stream, 2, [(2.0, 5.0)], 2.0)
    assert timer.finished() == [] and timer.pending == 2  # step 1 polled: not reached
    stream.run(4)  # into step 1: its start, a kernel, its "before", the wait
    _step(timer, comm, stream, 3, [], 3.0)
    assert timer.finished() == [] and timer.pending == 3
    stream.run()
    _step(timer, comm, stream, 4, [], 4.0)
    assert timer.finished() == [StepBusy(1, pytest.approx(0.002)),
                                StepBusy(2, pytest.approx(0.004)),
                                StepBusy(3, pytest.approx(0.003))]


def test_pending_steps_are_bounded_dropping_the_oldest_with_a_count():
    timer, comm, stream, _events = _setup(max_pending=2)
    for version in range(1, 6):
        _step(timer, comm, stream, version, [(1.0, 1.0)], float(version))
    assert timer.pending == 2 and timer.dropped == 3 and timer.finished() == []
    stream.run()
    _step(timer, comm, stream, 6, [], 1.0)
    assert [s.plan_version for s in timer.finished()] == [4, 5]
    assert timer.dropped == 3 and timer.pending == 1


def test_an_abandoned_step_is_never_reported_and_waits_outside_a_step_are_not_bracketed():
    timer, comm, stream, _events = _setup()
    with pytest.raises(TimeoutError):
        with timer.step(1, comm):
            stream.kernel(1.0)
            raise TimeoutError("a peer died")
    recorded = stream.recorded
    comm.wait(5.0, "the switch's exchange")  # no step open: no events
    seen = []
    with timer.step(2, comm):  # a wait on another thread is not this step's
        other = threading.Thread(target=lambda: (comm.wait(5.0, "elsewhere"), seen.append(1)))
        other.start()
        other.join(10)
        stream.kernel(2.0)
    assert seen == [1] and stream.recorded == recorded + 2  # the step's start and end only
    stream.run()
    _step(timer, comm, stream, 3, [], 1.0)
    assert timer.abandoned == 1
    # the other thread's wait ran on the stream inside step 2's one segment
    assert timer.finished() == [StepBusy(2, pytest.approx(0.007))]


def test_a_wait_outside_comm_is_left_out_when_it_says_so():
    timer, comm, stream, _events = _setup()
    with timer.step(1, comm):
        stream.kernel(1.0)
        with waiting():  # a fused BSR's exchange, say
            stream.kernel(30.0)
        stream.kernel(2.0)
    stream.run()
    _step(timer, comm, stream, 2, [], 1.0)
    assert timer.finished() == [StepBusy(1, pytest.approx(0.003))]


def test_events_of_finished_steps_are_reused():
    timer, comm, stream, events = _setup()
    for version in range(1, 20):
        _step(timer, comm, stream, version, [(1.0, 1.0)], 1.0)
        stream.run()
    assert len(timer.finished()) == 18
    assert len(events) <= 3 * 4  # each step: 4 events; at most the open, the pending, the free


@settings(max_examples=150, deadline=None, database=None, derandomize=True)
@given(st.lists(st.tuples(st.lists(st.tuples(st.floats(0, 50), st.floats(0, 50)), max_size=4),
                          st.floats(0, 50), st.integers(0, 12)), min_size=1, max_size=12),
       st.integers(1, 4))
def test_every_ended_step_is_reported_once_in_order_or_counted_dropped(steps, max_pending):
    timer, comm, stream, _events = _setup(max_pending=max_pending)
    reported: list[StepBusy] = []
    for version, (segments, last_ms, progress) in enumerate(steps):
        _step(timer, comm, stream, version, segments, last_ms)
        stream.run(progress)  # the GPU runs behind the host by some amount
        reported += timer.finished()
        assert timer.pending <= max_pending
    stream.run()
    _step(timer, comm, stream, len(steps), [], 0.0)  # reads back everything still kept
    reported += timer.finished()
    versions = [s.plan_version for s in reported]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert len(reported) + timer.dropped == len(steps)
    for s in reported:
        segments, last_ms, _ = steps[s.plan_version]
        assert s.busy_s == pytest.approx((sum(c for c, _w in segments) + last_ms) / 1000,
                                         abs=1e-9)


def test_bad_settings_are_one_line():
    with pytest.raises(ValueError, match=r"CudaEventTimer\(lag=2, max_pending=1"):
        CudaEventTimer(lambda: None, lag=2, max_pending=1)


def test_the_timer_follows_the_device_type():
    assert isinstance(step_timer("cpu"), HostTimer)
    assert isinstance(step_timer(torch.device("cpu")), HostTimer)
    stream = FakeStream()
    timer = step_timer(torch.device("cuda", 0), event_factory=lambda: FakeEvent(stream))
    assert isinstance(timer, CudaEventTimer) and stream.recorded == 0  # no event made yet


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@settings(max_examples=100, deadline=None, database=None, derandomize=True)
@given(st.lists(st.tuples(st.lists(st.tuples(st.floats(0, 5), st.floats(0, 5)), max_size=4),
                          st.booleans()), min_size=1, max_size=15))
def test_the_host_timer_gives_busy_meter_what_it_got_before(steps):
    """wall - waited, from the same clock readings and ``Comm.waited_s`` as the runtime took."""
    clock = _Clock()

    def waiter(seconds, what):
        clock.now += seconds
        comm.waited_s += seconds  # as a caller that waits elsewhere counts its waits in

    comm = Comm({}, 0, waiter)
    timer = HostTimer(clock)
    before, now = BusyMeter(window=4, skip=1, min_steps=1), BusyMeter(window=4, skip=1,
                                                                      min_steps=1)
    for version, (segments, abandon) in enumerate(steps):
        began, waited = clock(), comm.waited_s
        try:
            with timer.step(version // 3, comm):
                for compute_s, wait_s in segments:
                    clock.now += compute_s
                    comm.wait(wait_s, "all_reduce")
                if abandon:
                    raise TimeoutError("abandoned")
        except TimeoutError:
            continue
        before.add(version // 3, clock() - began, comm.waited_s - waited)
        for done in timer.finished():
            now.add_busy(done.plan_version, done.busy_s)
        assert (now.busy_s, now.steps) == (before.busy_s, before.steps)
    assert timer.abandoned == sum(a for _s, a in steps)


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA is not None, reason=str(NO_CUDA))
def test_real_cuda_events_exclude_the_waits_without_a_synchronisation(monkeypatch):
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    spans = []

    def waiter(work, what):  # the stream waits inside the brackets, as after NCCL's wait()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(work)
        b.record()
        spans.append((a, b))

    comm = Comm({}, 0, waiter, torch.device(device))
    timer = step_timer(device)
    assert isinstance(timer, CudaEventTimer)
    x = torch.randn(1024, 1024, device=device)
    outer = []
    for version in range(4):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        with timer.step(version, comm):
            y = x @ x
            comm.wait(2_000_000, "all_reduce")
            y = y @ x
        end.record()
        outer.append((begin, end))
    monkeypatch.undo()  # the test itself may synchronise now
    torch.cuda.synchronize()
    with timer.step(4, comm):
        pass
    done = timer.finished()
    assert [s.plan_version for s in done] == [0, 1, 2, 3] and timer.dropped == 0
    for s, (begin, end), (a, b) in zip(done, outer, spans):
        total_ms, wait_ms = begin.elapsed_time(end), a.elapsed_time(b)
        assert 0 < s.busy_s * 1000 <= total_ms - wait_ms + 5e-3
