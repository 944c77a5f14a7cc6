"""The background thread: queues ops by name, negotiates with rank 0, runs what is agreed.

Control flow (Horovod's model, with a coordinator):
  user thread   submit(Request) → queue, wake the thread
  every rank    sends its new requests to rank 0 (a cache id for an op it repeats
                unchanged, else the full signature), tagged with its epoch
  rank 0        records them (negotiation.Coordinator); when ops are ready on every
                rank it sends one message with the units to run, in order, to all
  every rank    runs the units (execution.Executor) and completes the handles

Waiting backs off (spin, then sleeps growing to 1-10 ms), and an idle rank's thread
sleeps on a condition variable: no op queued costs no CPU (rank 0 alone wakes ten
times a second to notice stalled ops of other ranks).

An abort (a rank raised or was interrupted) goes to rank 0, which fails every op in
flight on every rank and starts a new epoch; requests sent before a rank learned of
the new epoch are ignored, so the next cell starts clean.

When every rank of the engine is on one node and the shm transport runs, the ranks
agree through shared memory instead, each with a replica of the coordinator and no
round trip to rank 0 (agreement.py); NBDIST_AGREEMENT=coordinator keeps the MPI path.
There a thread that waits for an op (synchronize) first runs the agreement's cycles
itself for a moment (Engine.drive): a synchronous op then costs no hand-over to the
engine thread and back (two thread wake-ups, most of a small op's time); the engine
thread stays the one that waits for slow peers, and a lock lets one thread at a time
run cycles.

The interface (the same in both modes; process sets build one Engine per set over
that set's communicators, so nothing here is global): Engine(topology, config,
transports_factory); submit(Request) queues an op and completes its Handle;
abort(reason); stop(); auto_name(kind).
"""
from __future__ import annotations

import _signal
import collections
import functools
import os
import signal
import sys
import threading
import time
import traceback

from . import buffers, errors, timeline, world
from .config import env_str
from .execution import Executor
from .negotiation import Coordinator
from .requests import AutoName, Handle, Request, Response
from .transport import TransportError

TAG_TO_COORDINATOR = 11
TAG_FROM_COORDINATOR = 12
COORDINATOR = 0
_SIGINT = int(signal.SIGINT)
_MAIN_THREAD_ID = threading.main_thread().ident  # only it gets KeyboardInterrupt
STALL_CHECK_INTERVAL_S = 0.05  # rank 0 looks for stalled ops at most this often
# How long a waiting thread runs the shm agreement itself (Engine.drive) for peers to
# submit the op too before it leaves the wait to the engine thread: long enough for
# ranks that run the same step to meet, short enough not to take a core from a peer
# that is still computing.
DRIVE_WAIT_S = 2e-3
# How long a synchronous op the response cache knows waits (in one native call) for its
# peers to queue it too before it is queued as usual (Engine.express); it is part of
# DRIVE_WAIT_S: the driving that follows has the rest.
EXPRESS_WAIT_S = 1e-3
SHUTTING_DOWN = "nbdist is shutting down"  # why ops that wait give up at stop()


def _fine_timer_slack() -> None:
    """Ask Linux to time this thread's short sleeps to the microsecond.

    A thread's default timer slack (50 µs) stretches each sleep of the backoff by up
    to that much: most of a negotiation round's latency. Best effort; elsewhere a no-op.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK, 1 ns
    except Exception:
        pass


_blocking = threading.local()  # per thread: .depth of blocking() calls, .engines to wake


def blocking(fn):
    """Marks a collective that waits for its own result (allreduce, not allreduce_async).

    The ops it submits do not wake the engine thread: the calling thread runs them itself
    in synchronize() (Engine.drive), and a wake-up would only make the engine thread race
    it for them (a context switch and a hand-over, most of a small op's time on 2 cores).
    Whatever is still queued when the outermost such call returns, or raises, is handed
    to the engine thread then.
    """

    @functools.wraps(fn)
    def call(*args, **kwargs):
        local = _blocking
        depth = getattr(local, "depth", 0)
        local.depth = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            local.depth = depth
            engines = getattr(local, "engines", None)
            if not depth and engines:
                local.engines = None
                for engine in engines:
                    engine.wake_if_queued()

    return call


class Backoff:
    """Sleep schedule for polling: spin ~50 µs, then sleeps from 20 µs growing 1.5x to a cap.

    The cap is 250 µs for the first 200 ms of waiting, then 10 ms: quick answers stay
    quick, and a long wait (a slow peer) costs almost no CPU.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.delay = 0.0
        self.since = time.monotonic()

    def next_delay(self) -> float:
        waited = time.monotonic() - self.since
        if waited < 50e-6:
            return 0.0
        cap = 250e-6 if waited < 0.2 else 10e-3
        self.delay = min(cap, max(20e-6, self.delay * 1.5))
        return self.delay


class Engine:
    """One per process: owns the background thread and, on rank 0, the coordinator."""

    def __init__(self, topology, config, transports_factory):
        self.topology = topology
        self.config = config
        self.rank = topology.rank
        self.size = topology.size
        self.comm = topology.control_comm
        self.epoch = 0
        self._queue: collections.deque = collections.deque()
        # aborts to send, and rank 0's fusion threshold changes (set_fusion_threshold)
        self._control: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._local: dict[str, Request] = {}  # sent, waiting for a response
        self._names_in_flight: set[str] = set()
        self._cache: dict[str, tuple[int, tuple]] = {}  # name -> (cache id, my signature)
        self._templates: dict[int, Response] = {}
        self._sends: list = []
        self._probe = None  # (built on first use) the next control message, or None
        self._stopping = False
        self._broken: str | None = None
        self._abort_sent = False  # keep polling until rank 0's abort comes back
        self._last_alive_check = 0.0
        self._last_stall_check = 0.0
        self.auto_name_counter = 0
        self.join_round = 0  # completed join() calls: part of unnamed ops' names
        self.last_response_at = 0.0
        self.transports = transports_factory(self._should_stop)
        self.executor = Executor(self.rank, self.size, self.transports.for_op)
        self.agreement = None
        self.coordinator = None
        if self._use_shm_agreement():
            from .agreement import ShmAgreement

            self.agreement = ShmAgreement(self, topology, config)
            self._cache = self.agreement.coord.cache_by_name  # name -> cache id (for tests)
        elif self.rank == COORDINATOR:
            self.coordinator = Coordinator(self.size, config.fusion_threshold,
                                           config.cache_capacity, config.stall_warning_s,
                                           config.timeout_s, warn=self._warn)
        run = self._run_shm if self.agreement is not None else self._run
        self._thread = threading.Thread(target=run, name="nbdist-engine", daemon=True)
        self._thread.start()

    def _use_shm_agreement(self) -> bool:
        """Agree through shared memory: one node, shm transport (the same answer on every rank)."""
        mode = (env_str("AGREEMENT", "auto") or "auto").strip().lower() or "auto"
        if mode not in ("auto", "shm", "coordinator"):
            raise ValueError(f"NBDIST_AGREEMENT={mode!r}: use auto, shm or coordinator")
        on_one_node = (self.size > 1 and self.topology.local_size == self.size
                       and getattr(self.transports, "cpu_mode", "") == "shm")
        if mode == "shm" and not on_one_node:
            raise ValueError("NBDIST_AGREEMENT=shm needs every rank on one node with the shm "
                             "transport (the native module, and NBDIST_CPU_OPERATIONS not mpi)")
        return on_one_node and mode != "coordinator"

    # -- user-thread side ----------------------------------------------------------------
    def auto_name(self, kind: str) -> AutoName:
        """A name for an unnamed op; the counter restarts at each epoch so ranks stay aligned."""
        self.auto_name_counter += 1
        return self.last_auto_name(kind)

    def last_auto_name(self, kind: str) -> AutoName:
        """The name auto_name() gave last (the express table numbers the unnamed ops it runs
        by counting alone, and names one only when it must wait: ops.allreduce)."""
        return AutoName(f"{kind}.noname.{self.epoch}.{self.join_round}.{self.auto_name_counter}")

    def joined_all(self) -> None:
        """Every rank completed join(): restart the unnamed-op numbering in step.

        A joined rank skipped the unnamed ops the others ran meanwhile, so their counters
        differ; join's completion is an event every rank sees, the place to realign.
        """
        self.join_round += 1
        self.auto_name_counter = 0

    def submit(self, request: Request) -> None:
        """Queue an op; raises at once if its name is already in flight on this rank."""
        if self._broken:
            raise errors.RuntimeBrokenError(self._broken)
        with self._cv:
            if request.name in self._names_in_flight:
                # Refused here only, as Horovod does: the op already in flight under this
                # name goes on (its peers may be about to submit it).
                raise ValueError(f"{request.kind} '{request.name}' was submitted twice by rank "
                                 f"{self.rank} while in flight; give each in-flight op its "
                                 "own name")
            self._names_in_flight.add(request.name)
            self._queue.append(request)
            self._cv.notify()
        timeline.op_submitted(request.kind, request.name)
        if self.agreement is not None:
            request.handle.engine = self
            if getattr(_blocking, "depth", 0):  # the caller drives it (see blocking())
                engines = getattr(_blocking, "engines", None)
                if engines is None:
                    engines = _blocking.engines = set()
                engines.add(self)
            else:
                # (soon: this thread's synchronize, if it comes at once, runs the op itself
                # and spares the engine thread's wake-up its contention for the GIL)
                self.agreement.ring_soon()

    def wake_if_queued(self) -> None:
        """Hand ops a blocking call left queued (it raised, or did not drive) to the thread."""
        if self.agreement is not None and (self._queue or self._local):
            self.agreement.ring()

    def drive(self, handle) -> None:
        """Run the shm agreement in this (waiting) thread until `handle` is done, for a moment.

        Called by synchronize() before it waits. When the engine thread is not in a cycle,
        this thread runs what the engine thread would: take the queue, and start or join
        cycles; if the peers have not submitted the op within DRIVE_WAIT_S it leaves the
        rest to the engine thread (which it wakes). A Ctrl-C that arrives meanwhile is held
        until the cycle is over (a cycle left half-way would stop every rank's agreement)
        and then raised as usual.
        """
        agreement = self.agreement
        # The engine thread holds the lock for a moment after each wake-up (a peer's cycle
        # wakes it too); waiting for that beats handing the op over to it.
        if agreement is None or self._broken:
            return
        if not agreement.lock.acquire(timeout=DRIVE_WAIT_S):
            agreement.ring()  # the engine thread is in a long cycle: it runs this op next
            return
        gated = _sigint_gate.enter()
        try:
            agreement.hold(True)  # this thread joins the peers' cycles now
            self._drive_locked(agreement, handle)
        except BaseException as exc:
            self._runtime_failed(exc)
        finally:
            agreement.hold(False)
            agreement.lock.release()
            # The engine thread sleeps with a timeout computed before this op existed, and
            # may have slept through a peer's cycle start while this thread held the lock.
            if not handle.done() or self._local or agreement.peer_ahead():
                agreement.ring()
            if gated:
                _sigint_gate.leave()

    def express(self, kind: str, name: str, array, inplace: bool, op=0, postscale: float = 1.0,
                root: int = -1, drive: bool = True):
        """A synchronous allreduce, allgather or broadcast of an op the response cache knows,
        run by this (calling) thread with no Request, Handle or queue (ShmAgreement.express).

        The result array when it ran; a Handle to synchronize when the op had to wait
        after all (this thread drove it for a moment, as drive() does, unless `drive` is
        False: a small async op's submit, which must not wait longer); None when the path
        does not apply (no shm agreement, other ops in flight, the engine thread in a long
        cycle, an op not cached): then nothing was done and the caller submits as usual.
        """
        agreement = self.agreement
        if agreement is None or self._broken or self._stopping:
            return None
        lock = agreement.lock
        if not (lock.acquire(False) or lock.acquire(timeout=DRIVE_WAIT_S)):
            return None
        return self._express_locked(agreement, _sigint_gate.enter(), drive, agreement.express,
                                    kind, name, array, inplace, op, postscale, root,
                                    EXPRESS_WAIT_S)

    def express_resume(self, kind: str, name: str, array, inplace: bool, started: tuple,
                       drive: bool = True):
        """The rest of an op the native express table started (ops' synchronous forms, and
        small async ops): it returned `started`, (vote, output, error, Ctrl-C gate
        entered), with the agreement lock held. The result, or a Handle, as express()
        returns them."""
        voted, out, error, gated = started
        agreement = self.agreement
        return self._express_locked(agreement, gated, drive, agreement.express_resumed, kind,
                                    name, array, inplace, out, voted, error)

    def _express_locked(self, agreement, gated: bool, drive: bool, step, *args):
        """express()'s work under the agreement lock, which it releases: step(*args) (the op
        published as queued from its start), then, with `drive`, the driving of a Handle it
        returns."""
        result = None
        try:
            # (the native call holds the engine thread's activity watch from its start, and
            # lets go once the op ran: see hold(); else it is let go below)
            result = step(*args)
            if drive and result.__class__ is Handle:
                self._drive_locked(agreement, result, DRIVE_WAIT_S - EXPRESS_WAIT_S)
        except BaseException as exc:
            self._runtime_failed(exc)
            if result is None:  # the op had no handle yet to carry the error
                raise errors.RuntimeBrokenError(str(self._broken)) from None
        finally:
            if result is None or result.__class__ is Handle:
                agreement.hold(False)
            agreement.lock.release()
            # Unlike drive(), no ring for a peer that started a cycle meanwhile: in a loop of
            # synchronous ops this thread joins it with its next op in microseconds, and a
            # woken engine thread would join it first, without that op (the peer's then
            # waits as a queued one). If no next op comes, the engine thread, whose watch
            # was held, looks again within 1-16 ms (HELD_RECHECK_NS, backing off) and joins it then.
            if (result.__class__ is Handle and not result.done()) or self._local or self._queue:
                agreement.ring()
            if gated:
                _sigint_gate.leave()
        return result

    def _drive_locked(self, agreement, handle, wait_s: float = DRIVE_WAIT_S) -> None:
        deadline = 0.0
        while not handle.done():
            with self._cv:
                if self._stopping:
                    return
                new, control = self._drain_locked()
            now = time.monotonic()
            items = agreement.prepare(new, control, now)
            if items or agreement.must_cycle(now) or agreement.peer_ahead():
                agreement.cycle(items)
                continue
            if not deadline:
                deadline = now + wait_s
            elif now >= deadline:
                return
            os.sched_yield()  # a peer sharing this core gets to submit its op

    def set_fusion_threshold(self, nbytes: int) -> None:
        """Fuse ready allreduces up to `nbytes` a unit (0: none) from the next cycle that
        agrees on ops (autotune). Rank 0's call decides for every rank, and the others' is
        ignored: the MPI coordinator is rank 0, and with the shm agreement rank 0 sends the
        change as an item, which every replica applies at the same place in the same cycle
        (a change made by each rank at its own moment could fuse one cycle's ops in
        different units on different ranks)."""
        if self.rank != 0:
            return
        with self._cv:
            self._control.append(("fusion", int(nbytes)))
            self._cv.notify()
        if self.agreement is not None:
            self.agreement.ring()

    def abort(self, reason: str, wait_s: float = 5.0) -> None:
        """Fail every op in flight on every rank with `reason`.

        Waits (up to wait_s) until this rank has seen the abort come back from rank 0,
        so the ops it submits afterwards belong to the new epoch and run normally.
        """
        with self._cv:
            epoch = self.epoch
            self._control.append(("abort", reason))
            self._cv.notify()
        if self.agreement is not None:
            self.agreement.ring()
        deadline = time.monotonic() + wait_s
        while self.epoch == epoch and time.monotonic() < deadline and not self._broken:
            time.sleep(0.001)

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self.agreement is not None:
            self.agreement.ring()
        self._thread.join(timeout)
        self._fail_all(errors.NbdistError("nbdist was shut down while this op was in flight"))
        if self.agreement is not None and not self._thread.is_alive():
            # Peers waiting in a cycle for this rank fail now instead of at their timeout.
            self.agreement.close(f"rank {self.rank} shut down nbdist")
        self.transports.close()
        buffers.clear_pool()  # an idle notebook engine keeps no freed results' memory

    # -- background thread -----------------------------------------------------------------
    def _warn(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def _should_stop(self) -> str | None:
        """Asked by transports while they wait: a reason to give up, or None."""
        return SHUTTING_DOWN if self._stopping else None

    def _take_queued(self) -> tuple[list, list] | None:
        """The ops and control items queued since the last look, or None once stop() was asked."""
        with self._cv:
            if self._stopping:
                return None
            return self._drain_locked()

    def _drain_locked(self) -> tuple[list, list]:
        """Empty the op and control queues; the caller holds self._cv."""
        if self.agreement is not None:
            self.agreement.clear_absorbed()  # (before the take: a later submit rings again)
        new, control = list(self._queue), list(self._control)
        self._queue.clear()
        self._control.clear()
        return new, control

    def _run(self) -> None:
        backoff = Backoff()
        _fine_timer_slack()
        try:
            while True:
                taken = self._take_queued()
                if taken is None:
                    return
                new, control = taken
                worked = self._cycle(new, control)
                if worked:
                    timeline.cycle()
                    backoff.reset()
                    continue
                delay = backoff.next_delay()
                with self._cv:
                    if self._queue or self._control or self._stopping:
                        continue
                    if self._idle():
                        # Rank 0 still wakes now and then to watch other ranks' stalls.
                        self._cv.wait(0.1 if self.coordinator is not None else None)
                        backoff.reset()
                    elif delay:
                        self._cv.wait(delay)
        except BaseException as exc:  # a transport failure: the runtime cannot go on
            self._broken = (f"nbdist runtime on rank {self.rank} stopped after an internal "
                            f"error: {type(exc).__name__}: {exc}; call shutdown() and init() again")
            self._warn(self._broken + "\n" + traceback.format_exc())
            self._fail_all(errors.RuntimeBrokenError(self._broken))

    def _run_shm(self) -> None:
        """The engine thread with the shm agreement: cycle when there is news, else sleep.

        A cycle runs under the agreement's lock, which a waiting user thread may hold
        instead (drive): after each wake-up this thread looks again at what there is to do.
        """
        agreement = self.agreement
        _fine_timer_slack()
        try:
            while True:
                with agreement.lock:
                    if self._broken:
                        return  # a cycle in drive() failed: it failed the ops already
                    taken = self._take_queued()
                    if taken is None:
                        return
                    new, control = taken
                    now = time.monotonic()
                    items = agreement.prepare(new, control, now)
                    # A peer ahead started a cycle: join it (with whatever is queued now).
                    if items or agreement.must_cycle(now) or agreement.peer_ahead():
                        agreement.cycle(items)
                        continue
                    timeout = agreement.next_timeout(now)
                if agreement.wait(timeout) == 3:
                    # The segment was aborted: a peer died, shut down or gave up. Under the
                    # lock: a user thread may be in a cycle (drive, express) whose ops were
                    # agreed before the abort and complete without that peer (a rank that
                    # finished the last op and shut down while this one still copies the
                    # result out); it finishes first, and only what is left in flight fails.
                    with agreement.lock:
                        self._stopped_by_abort(agreement.abort_reason())
                    return
        except BaseException as exc:  # a transport failure: the runtime cannot go on
            self._runtime_failed(exc)

    def _stopped_by_abort(self, reason: str) -> None:
        """The agreement segment was aborted (a peer died, shut down or gave up, or this
        rank gave up): fail every op still in flight with its reason (the first reason the
        runtime stopped for, if it had stopped already); the runtime stops."""
        if not self._broken:
            self._broken = (f"nbdist runtime on rank {self.rank} stopped: {reason}; "
                            "call shutdown() and init() again")
        self._fail_all(errors.RuntimeBrokenError(self._broken))

    def _runtime_failed(self, exc: BaseException) -> None:
        """A cycle raised (a transport failure): fail every op; this runtime cannot go on."""
        aborted = self.agreement.abort_reason() if self.agreement is not None else ""
        # The cycle met the segment's abort: its reason is the cause, as above. Already
        # broken: ops a failed unit handed back since fail with the same error.
        if aborted or self._broken:
            self._stopped_by_abort(aborted)
            return
        # A transport's own failure (a peer died mid-transfer) names its cause itself.
        own = isinstance(exc, TransportError)
        cause = f": {exc}" if own else f" after an internal error: {type(exc).__name__}: {exc}"
        self._broken = (f"nbdist runtime on rank {self.rank} stopped{cause}; "
                        "call shutdown() and init() again")
        if self.agreement is not None:
            # Peers already waiting in the agreement for this rank (they left the failed op
            # first: a single-copy broadcast's readers) learn the cause now, not at their
            # next dead-peer check, which would name whichever rank died first.
            self.agreement.abort(str(exc) if own else f"rank {self.rank} stopped{cause}")
        # In an elastic world a dead peer is an expected event: hvd.elastic.run rebuilds the
        # world and the driver reports the loss, so a warning on every survivor telling the
        # user to re-init would only mislead. Ops still fail with RuntimeBrokenError.
        if not self._stopping and not world.elastic_dir():
            self._warn(self._broken + "\n" + traceback.format_exc())
        self._fail_all(errors.RuntimeBrokenError(self._broken))

    def _on_abort(self, epoch: int, reason: str) -> None:
        """Every rank: fail every op in flight with the abort's reason; a new epoch starts."""
        self._fail_all(errors.AbortedError(reason))
        self.auto_name_counter = 0
        self._abort_sent = False
        self.epoch = epoch  # last: abort() returns once it sees this

    def _idle(self) -> bool:
        coordinator_idle = self.coordinator is None or not self.coordinator.has_work()
        return (not self._local and coordinator_idle and not self._sends
                and not self._abort_sent)

    def _cycle(self, new: list[Request], control: list[tuple]) -> bool:
        """One pass: take in messages, send requests, run what is agreed. True if it did work."""
        worked = self._drain_incoming()  # first, so an abort from rank 0 is seen before sending
        if self._sends:
            self._sends = [s for s in self._sends if not s.Test()]
        if new:
            worked = True
            self._send_requests(new)
        if control:
            worked = True
            for item in control:
                self._send_control(item)
        if self.coordinator is not None:
            worked = self._coordinate() or worked
        else:
            self._check_coordinator_alive()
        return worked

    def _check_coordinator_alive(self) -> None:
        """Fail ops rank 0 never answered: it times ops out itself, so silence means it is gone."""
        if not self.config.timeout_s or not self._local:
            return
        now = time.monotonic()
        if now - self._last_alive_check < 1.0:
            return
        self._last_alive_check = now
        limit = self.config.timeout_s + 30.0
        for name, req in list(self._local.items()):
            if now - req.sent_at > limit:
                del self._local[name]
                with self._cv:
                    self._names_in_flight.discard(name)
                req.handle.set_error(errors.CollectiveTimeoutError(
                    f"{req.kind} '{name}': rank {COORDINATOR} (the coordinator) gave no answer "
                    f"for {now - req.sent_at:.0f} s; it may have stopped, shut down or died"))

    def _send_control(self, item: tuple) -> None:
        message = (item[0], self.epoch, self.rank) + item[1:]
        if item[0] == "abort":
            self._abort_sent = True
        if self.coordinator is not None:
            self._on_message(message)
        else:
            self._sends.append(self.comm.isend(message, dest=COORDINATOR, tag=TAG_TO_COORDINATOR))

    def _send_requests(self, new: list[Request]) -> None:
        items: list = []
        now = time.monotonic()
        for req in new:
            req.sent_at = now
            self._local[req.name] = req
            cached = self._cache.get(req.name)
            if cached is not None and cached[1] == req.signature:
                items.append(cached[0])
            else:
                items.append((req.name, req.signature, req.named))
        message = ("req", self.epoch, self.rank, items)
        if self.coordinator is not None:
            self._on_message(message)
        else:
            self._sends.append(self.comm.isend(message, dest=COORDINATOR, tag=TAG_TO_COORDINATOR))

    def _drain_incoming(self) -> bool:
        if self.size == 1:
            return False
        probe = self._probe
        if probe is None:
            from mpi4py import MPI

            status = MPI.Status()
            if self.coordinator is not None:
                source, tag = MPI.ANY_SOURCE, TAG_TO_COORDINATOR
            else:
                source, tag = COORDINATOR, TAG_FROM_COORDINATOR
            comm = self.comm

            def probe():
                if not comm.Iprobe(source=source, tag=tag, status=status):
                    return None
                return comm.recv(source=status.Get_source(), tag=tag)

            self._probe = probe
        handle = self._on_message if self.coordinator is not None else self._on_broadcast
        worked = False
        while True:
            message = probe()
            if message is None:
                return worked
            worked = True
            handle(message)

    # -- rank 0: the coordinator ------------------------------------------------------------
    def _on_message(self, message: tuple) -> None:
        kind, epoch, rank = message[0], message[1], message[2]
        coord = self.coordinator
        if kind == "fusion":  # (rank 0's own: set_fusion_threshold)
            coord.fusion_threshold = message[3]
            return
        if kind == "abort":
            if epoch < coord.epoch:
                return  # another abort already failed that rank's ops (its abort() sees it)
            # Name the ops the abort fails: a rank that was idle learns of the abort only at
            # its next cycle, and the requests it sent meanwhile (a new cell's) must not fail
            # for the old reason; they were dropped here as stale and are sent again.
            aborted = frozenset(coord.pending)
            new_epoch = coord.abort()
            self._broadcast(("abort", new_epoch, message[3], aborted))
            return
        if epoch != coord.epoch:
            return  # sent before that rank learned of an abort: it failed these already
        if kind == "req":
            immediate = []
            for item in message[3]:
                immediate += coord.add(rank, item)
            if immediate:
                self._broadcast(("units", coord.epoch, [[r] for r in immediate]))

    def _coordinate(self) -> bool:
        coord = self.coordinator
        failed = None
        now = time.monotonic()
        if now - self._last_stall_check >= STALL_CHECK_INTERVAL_S:
            self._last_stall_check = now
            failed = coord.check_stalls()
        if failed:
            self._broadcast(("units", coord.epoch, [[r] for r in failed]))
        if not coord.has_ready():
            return bool(failed)
        # Let a burst (a backward pass) gather for fusion, up to one cycle.
        if (coord.partially_submitted()
                and now - self.last_response_at < self.config.cycle_time_ms / 1000.0):
            return bool(failed)
        self.last_response_at = now
        self._broadcast(("units", coord.epoch, coord.take_units()))
        return True

    def _broadcast(self, message: tuple) -> None:
        """Send a message to every rank (rank 0 handles its own copy directly)."""
        for dest in range(1, self.size):
            self._sends.append(self.comm.isend(message, dest=dest, tag=TAG_FROM_COORDINATOR))
        self._on_broadcast(message)

    # -- every rank: run what rank 0 decided -------------------------------------------------
    def _on_broadcast(self, message: tuple) -> None:
        kind, epoch = message[0], message[1]
        if kind == "abort":
            self._on_named_abort(epoch, message[2], message[3])
            return
        templates = self._templates
        if timeline.active() is not None:  # all of this message is agreed: QUEUE from here
            for unit in message[2]:
                for e in unit:
                    resp = templates.get(e) if e.__class__ is int else e
                    if resp is not None and resp.error is None:
                        for name in resp.names:
                            if name in self._local:
                                timeline.op_agreed(resp.kind, name)
        for unit in message[2]:
            responses = []
            for e in unit:
                if e.__class__ is int:  # a cached response: known here already
                    responses.append(templates[e])
                    continue
                responses.append(e)
                if e.cache_id >= 0 and e.error is None:
                    templates[e.cache_id] = e
                    req = self._local.get(e.names[0])
                    if req is not None:
                        self._cache[e.names[0]] = (e.cache_id, req.signature)
            self.executor.run_unit(responses, self._local, self._release_names)

    def _on_named_abort(self, epoch: int, reason: str, aborted: frozenset) -> None:
        """Coordinator path: fail the ops the abort names (those rank 0 had in flight); send the
        rest again in the new epoch: rank 0 dropped them as sent before this rank knew."""
        with self._cv:
            failed = [req for name, req in self._local.items() if name in aborted]
            for req in failed:
                del self._local[req.name]
                self._names_in_flight.discard(req.name)
            resend = list(self._local.values())
            self._local.clear()
        error = errors.AbortedError(reason)
        for req in failed:
            req.handle.set_error(error)
        self.auto_name_counter = 0
        self._abort_sent = False
        self.epoch = epoch  # abort() returns once it sees this; resent requests carry it
        if resend:
            self._send_requests(resend)

    def _release_names(self, names: list[str]) -> None:
        """These ops are about to complete: their names may be submitted again."""
        with self._cv:
            self._names_in_flight.difference_update(names)

    def _fail_all(self, error: BaseException) -> None:
        """Fail every op this rank has queued or in flight."""
        with self._cv:
            pending = list(self._queue) + list(self._local.values())
            self._queue.clear()
            self._local.clear()
            self._names_in_flight.clear()
        if self.agreement is not None:
            self.agreement.bit_pending.clear()
        for req in pending:
            req.handle.set_error(error)


class _SigintGate:
    """Holds a Ctrl-C (SIGINT) that arrives in the main thread while it runs agreement cycles,
    and delivers it once the cycle is over: a cycle left half-way would stop every rank's
    agreement.

    Installed once as the SIGINT handler, in front of the handler it found (and again if
    someone replaced it since, in front of theirs); outside a cycle it hands the signal
    straight to that handler, so Ctrl-C behaves as before. A cycle then costs two counter
    updates instead of two handler swaps (each a sigaction system call, on the path of
    every synchronous op). A no-op outside the main thread (only the main thread gets
    KeyboardInterrupt) and where the handler was not installed from Python (it could not
    be handed on).
    """

    def __init__(self):
        self.previous = None  # the handler found when installed: what a signal goes to
        self.depth = 0  # cycles running in the main thread now
        self.frame = None  # a signal held until they are over

    def __call__(self, signum, frame) -> None:
        if self.depth:
            self.frame = frame or sys._getframe(0)
            return
        self._deliver(frame)

    def enter(self) -> bool:
        """A cycle starts in this thread: True when a Ctrl-C is held from now (call leave())."""
        if threading.get_ident() != _MAIN_THREAD_ID:
            return False
        if _signal.getsignal(_SIGINT) is not self:
            current = _signal.getsignal(_SIGINT)
            if current is None:
                return False
            self.previous = current
            _signal.signal(_SIGINT, self)
        self.depth += 1
        return True

    def leave(self) -> None:
        """The cycle is over: deliver a Ctrl-C that arrived meanwhile."""
        self.depth -= 1
        if self.depth or self.frame is None:
            return
        frame, self.frame = self.frame, None
        self._deliver(frame)

    def _deliver(self, frame) -> None:
        previous = self.previous
        if callable(previous):
            previous(_SIGINT, frame)  # default_int_handler: KeyboardInterrupt
        elif previous == signal.SIG_DFL:
            _signal.signal(_SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), _SIGINT)


_sigint_gate = _SigintGate()
