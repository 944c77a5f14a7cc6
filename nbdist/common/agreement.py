"""Agreement on one node through shared memory: every rank decides the same, no round trip to rank 0.

Used by the engine when all of its ranks share one node and the native module is
there (the shm CPU transport); across nodes, or with NBDIST_AGREEMENT=coordinator, the
engine keeps its MPI coordinator (engine.py). Horovod's model, in lockstep cycles:

  cycle   every rank contributes one small int32 vector to a Min-allreduce on an shm
          segment of this engine's own: slot r holds -(bytes of rank r's new items),
          then one slot per cached response holds 1 if this rank has that op queued.
          The Min is the AND of the cache bits: the repeated ops ready on every rank,
          known at once on every rank, with no message through rank 0.
  items   when some rank has new items (an op seen for the first time or changed, an
          abort, rank 0's timeouts), they are pickled and
          allgathered over the same segment, and every rank feeds all of them, in rank
          order, into its own replica of the Coordinator (negotiation.py): the same
          inputs in the same order give the same responses, fusion and cache ids on
          every rank, and the same MismatchError messages as before.
  run     every rank runs the same units in the same order (execution.Executor).

A rank starts a cycle only when it has something new to say; the others join when
they see its counter move (ShmComm.wait_activity: a futex sleep, so an idle or waiting
engine costs no CPU, and no rank polls). Time-based decisions are made by one clock:
rank 0 sends the timeouts as items. A cached op still waiting after DEMOTE_S goes
through the items path, so the replicas see who is missing (stall warnings, timeouts).
While ops are in flight a rank starts an empty cycle every KEEPALIVE_S: the native wait
inside it notices a dead peer (and names it) within ~0.1 s.

The express path (express(), from Engine.express): a synchronous allreduce, allgather or
broadcast of a cached op, with nothing else in flight on this rank, needs none of the above in
Python. One native call publishes the op as queued, waits a moment for the peers to
queue theirs, votes (the op's cache bit alone) and, when the vote finds it ready on
every rank and no items, moves the bytes: a small allreduce in the vote's own slot
(ShmComm::vote), else on the data segment. Ranks on the express path and ranks that run
the same cycle through cycle() meet in the same collectives.

Unnamed ops (an AutoName, numbered in submission order) have no name to cache: the
replicas keep the first ones' signatures as templates (Coordinator.unnamed_cid), and a
rank sets a template's bit for its oldest unnamed op in flight only, so the bits that meet
in a vote stand for ops of one number on every rank (see _cached_id).
"""
from __future__ import annotations

import copy
import math
import pickle
import threading
import time

import numpy as np

from . import buffers, timeline
from .negotiation import Coordinator
from .requests import ALLGATHER, ALLREDUCE, AutoName, Handle, Request, signature
from .transport import TransportError
from .transports._dtypes import dtype_code, op_code

DEMOTE_S = 0.25  # a cached op waiting longer than this is sent in full (stall bookkeeping)
KEEPALIVE_S = 0.5  # with ops in flight, cycle at least this often (dead-peer detection)
STALL_CHECK_INTERVAL_S = 0.05  # rank 0 looks for timed-out ops at most this often
CONTROL_SLOT_BYTES = 64 * 1024
CONTROL_SPIN, CONTROL_YIELDS = 50, 8  # polls before yielding, and before the futex sleep


_RAN = object()  # _vote_and_run_one ran the op with the vote


def _request_item(req: Request, cid: int | None) -> tuple:
    """The item that sends `req` through the replicas: its cache id when it has one (and a
    name to find it by), else its full signature."""
    if req.auto_named:  # by its number, always (a plain str travels lighter than an AutoName)
        return ("r", (str(req.name), req.signature, False, True))
    if cid is not None:
        return ("r", cid)
    return ("r", (req.name, req.signature, req.named))


def _response_for(entry, req: Request):
    """The response of a cached op whose bit was ready: an unnamed op's template names the
    op it was first agreed for, so the op that takes it gets a copy with its own name."""
    resp = entry.response
    if entry.unnamed:
        resp = copy.copy(resp)
        resp.names = [req.name]
    return resp


def _quiet(message: str) -> None:
    """Stall warnings are printed by rank 0 only (every replica computes them)."""


class _ExpressPlan:
    """What express() needs of one cached op: what identifies the op's signature without
    building it (the kind, the array's dtype object and shape, the op, the postscale, the
    root), the signature, the data transport, and the native call's own arguments
    (allreduce: dtype and op codes, factor; allgather: bytes from each rank, and the
    result's shape; broadcast: bytes and root)."""

    __slots__ = ("kind", "cid", "sig", "dtype", "shape", "op", "postscale", "root",
                 "transport", "args", "out_shape")

    def __init__(self, kind: str, cid: int, sig: tuple, array: np.ndarray, op, postscale: float,
                 root: int, transport, args: tuple, out_shape: tuple = ()):
        self.kind, self.cid, self.sig = kind, cid, sig
        self.dtype, self.shape, self.op, self.postscale = array.dtype, array.shape, op, postscale
        self.root = root
        self.transport, self.args, self.out_shape = transport, args, out_shape


class ShmAgreement:
    """One engine's agreement state: the control segment, the coordinator replica, cache bits."""

    def __init__(self, engine, topology, config):
        from .transports.shm import ShmTransport

        if topology.local_size != topology.size:
            raise ValueError("the shm agreement needs every rank of the engine on one node")
        self.engine = engine
        self.rank, self.size = topology.rank, topology.size
        # A segment of this engine's own (one per engine, so one per process set).
        self.seg = ShmTransport(topology.local_comm, topology.rank, config.timeout_s,
                                engine._should_stop, slot_bytes=CONTROL_SLOT_BYTES, nsets=2,
                                single_copy=False)  # its scratch words carry publish_queued
        self.native = self.seg._native
        # A cycle's wait is for peers to arrive: during training, a peer still in its
        # backward pass. Spinning there takes the core from that computation (2 ranks on
        # 2 cores are oversubscribed once each has an engine thread), so spin briefly and
        # sleep on the futex soon; the data ops that follow a cycle start in step.
        self.native.set_tuning(CONTROL_SPIN, CONTROL_YIELDS, 64 * 1024, 0)
        self.coord = Coordinator(self.size, config.fusion_threshold, config.cache_capacity,
                                 config.stall_warning_s, config.timeout_s,
                                 warn=engine._warn if self.rank == 0 else _quiet,
                                 cache_unnamed=True)
        # Held by whichever thread runs cycles: the engine thread, or a thread that waits
        # for an op and runs them itself meanwhile (Engine.drive). Everything below is
        # touched under it.
        self.lock = threading.Lock()
        self.bit_pending: dict[int, Request] = {}  # cache id -> this rank's queued op
        self.last_stall_check = 0.0
        self.last_cycle = 0.0
        self.news = False
        # cycles; those with items; ops run by the vote's own native call (_vote_and_run_one,
        # express); of those, ops that had no Request or Handle (express); see stats
        self._counts = {"cycles": 0, "item_cycles": 0, "ran_with_vote": 0, "express": 0}
        # name -> what express() needs of that cached op (see _express_plan); (kind,) for
        # the last unnamed op of that kind
        self._express_plans: dict[str | tuple, _ExpressPlan] = {}
        # The same plans again (by kind and name; an unnamed template's under None), in the
        # native table that runs them with no Python at all (ops' synchronous forms try it
        # first: native/express_table.cpp); its runs count in the stats.
        self.express_table = self._new_express_table()
        engine.executor.counted_elsewhere = self._express_table_runs

    def _new_express_table(self):
        from nbdist import _native

        from . import process_sets
        from .engine import (_MAIN_THREAD_ID, EXPRESS_WAIT_S, SHUTTING_DOWN, _signal,
                             _sigint_gate)

        return _native.ExpressTable(
            self.native, self.engine, self, _sigint_gate, _signal.getsignal, _MAIN_THREAD_ID,
            vars(timeline), process_sets.global_process_set, EXPRESS_WAIT_S, self.seg.timeout_s,
            buffers.POOL_MIN_BYTES, buffers.empty_like, buffers.empty, SHUTTING_DOWN)

    def _express_table_runs(self) -> tuple[int, int]:
        table = self.express_table
        return table.runs, table.allreduce_runs

    @property
    def stats(self) -> dict[str, int]:
        """The counters (see _counts), with the ops the express table ran."""
        stats = dict(self._counts)
        ran = self.express_table.runs
        for key in ("cycles", "ran_with_vote", "express"):
            stats[key] += ran
        return stats

    # -- what this rank has to say --------------------------------------------------------
    def _bit_ok(self, name: str) -> bool:
        """A cached op may wait as a bit unless the replicas track it by name (deterministic)."""
        coord = self.coord
        return not coord.joined and name not in coord.pending and name not in coord.tombstones

    def prepare(self, new: list[Request], control: list[tuple], now: float) -> list[tuple]:
        """Take in new requests and control items; the items to send in the next cycle."""
        coord = self.coord
        items: list[tuple] = []
        local = self.engine._local
        for req in new:
            req.sent_at = now
            cid = self._cached_id(req, local)
            local[req.name] = req
            if cid is not None and self._bit_ok(req.name):
                self.bit_pending[cid] = req
                self.news = True  # a new bit: the next cycle may find the op ready
            else:
                items.append(_request_item(req, cid))
        for cid, req in list(self.bit_pending.items()):
            # (an unnamed op's: also when a peer sent that op in full, as it is then pending)
            if now - req.sent_at > DEMOTE_S or not self._bit_ok(req.name):
                del self.bit_pending[cid]
                items.append(_request_item(req, cid))
        # the engine's control items: aborts, and rank 0's fusion threshold changes
        items += [("a" if item[0] == "abort" else "f", item[1]) for item in control]
        if (self.rank == 0 and coord.pending
                and now - self.last_stall_check >= STALL_CHECK_INTERVAL_S):
            self.last_stall_check = now
            items += [("t", name, age) for name, age in coord.overdue()]
        return items

    def _cached_id(self, req: Request, local: dict) -> int | None:
        """The cache id whose bit may stand for `req`: its name's, with this signature; an
        unnamed op's template (Coordinator.unnamed_cid) when it is this rank's oldest unnamed
        op in flight (`local` does not hold it yet)."""
        if req.auto_named and any(r.auto_named for r in local.values()):
            return None
        return self._cache_id_of(req.name, req.signature)

    def _cache_id_of(self, name: str, sig: tuple) -> int | None:
        """The cache id of an op named `name` with this rank's signature `sig`: the named
        op's entry, an unnamed op's template (an AutoName), or None."""
        coord = self.coord
        if name.__class__ is AutoName:
            return coord.unnamed_cid(self.rank, sig)
        cid = coord.cache_by_name.get(name)
        if cid is not None and coord.cache_by_id[cid].sigs.get(self.rank) == sig:
            return cid
        return None

    def must_cycle(self, now: float) -> bool:
        """True when a cycle is due without new items: a new cache bit that may complete an
        op, or a keep-alive while ops are in flight.

        A new bit starts a cycle only if every peer has ops queued too: otherwise the AND
        is certainly empty, and the peer that is missing starts the cycle when it submits
        (its bit is news to it). That saves the empty cycle the first rank to submit would
        run in each step.
        """
        if self.news:
            self.native.publish_queued(len(self.bit_pending))
            if self.native.peers_queued():
                return True
        return bool(self.engine._local) and now - self.last_cycle >= KEEPALIVE_S

    def next_timeout(self, now: float) -> float:
        """How long the engine may sleep before prepare()/must_cycle() could say something."""
        timeout = 5.0
        if self.engine._local:
            timeout = KEEPALIVE_S - (now - self.last_cycle)
        if self.bit_pending:
            oldest = min(req.sent_at for req in self.bit_pending.values())
            timeout = min(timeout, oldest + DEMOTE_S - now)
        if self.rank == 0 and self.coord.pending:
            timeout = min(timeout, STALL_CHECK_INTERVAL_S)
        return max(timeout, 0.0005)

    def wait(self, timeout: float) -> int:
        """Sleep until a peer starts a cycle (1), ring() (2), an abort (3) or the timeout (0)."""
        return self.native.wait_activity(timeout)

    def ring(self) -> None:
        self.native.ring()

    def ring_soon(self) -> None:
        """ring(), for an op this thread will likely drive in a moment (an async submit):
        the engine thread leaves it to a thread that holds the watch within a few yields."""
        self.native.ring_soon()

    def clear_absorbed(self) -> None:
        """The queue is being taken: a ring_soon() left to the watch's holder is answered."""
        self.native.clear_absorbed()

    def hold(self, on: bool) -> None:
        """While on, the engine thread's wait() does not watch the peers (a driver does)."""
        self.native.hold_activity(on)

    def peer_ahead(self) -> bool:
        """A peer has started a cycle this rank has not joined yet."""
        return self.native.peer_ahead()

    # -- one cycle, collective over the engine's ranks ---------------------------------------
    def _begin_cycle(self) -> int:
        """A cycle starts: its bookkeeping; the vote's number of cache slots."""
        self.last_cycle = time.monotonic()
        self.news = False
        self.native.publish_queued(len(self.bit_pending))
        self._counts["cycles"] += 1
        return self._vote_slots()

    def _vote_slots(self) -> int:
        """The vote's number of cache slots: the cache's size rounded up to 16 (the same on
        every rank: replicas)."""
        return -(-len(self.coord.cache_by_id) // 16) * 16

    def cycle(self, items: list[tuple]) -> None:
        nbits = self._begin_cycle()
        voted = None if items else self._vote_and_run_one(nbits)
        if voted is _RAN:
            return
        payload = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL) if items else b""
        if voted is None:
            # The AND of the bits comes back as a subset of this rank's own, sorted by cache
            # id as the replicas' fusion expects.
            lengths, ready = self.seg.agree(len(payload), list(self.bit_pending), nbits)
        else:
            lengths, ready = voted
        self._after_vote(payload, lengths, ready)

    def _after_vote(self, payload: bytes, lengths: list[int], ready: list[int]) -> None:
        """The rest of a cycle once the vote is in: the items' allgather, the replicas, the
        units to run."""
        eng, coord, size = self.engine, self.coord, self.size
        # (a vote that could have run this rank's one op unqueued it: still queued now)
        self.native.publish_queued(len(self.bit_pending))
        units: list[list] = []
        if any(lengths):  # some rank sent items: new or changed ops, aborts, timeouts
            self._counts["item_cycles"] += 1
            per_rank: list[list] = [[] for _ in range(size)]
            recv = np.empty(sum(lengths), np.uint8)
            self.seg.allgatherv(np.frombuffer(payload, np.uint8), recv, lengths)
            offset = 0
            for r, n in enumerate(lengths):
                if n:
                    per_rank[r] = pickle.loads(recv[offset:offset + n])  # type: ignore[arg-type]
                offset += n
            aborts = [item[1] for items_r in per_rank for item in items_r if item[0] == "a"]
            if aborts:  # every rank fails every op in flight, and the next epoch starts clean
                self.bit_pending.clear()
                self.native.publish_queued(0)
                eng._on_abort(coord.abort(), aborts[0])
                return
            for r, items_r in enumerate(per_rank):
                for item in items_r:
                    tag = item[0]
                    if tag == "r":
                        units += [[resp] for resp in coord.add(r, item[1])]
                    elif tag == "t":
                        units += [[resp] for resp in coord.fail_stalled(item[1], item[2])]
                    elif tag == "f":  # before this cycle's units are fused, on every replica
                        coord.fusion_threshold = item[1]
        if coord.ready:
            by_id = coord.cache_by_id
            units += [[by_id[e].response if e.__class__ is int else e for e in unit]
                      for unit in coord.take_units()]
        if ready:
            by_id = coord.cache_by_id
            bit_pending = self.bit_pending
            reqs = {cid: bit_pending.pop(cid) for cid in ready}
            # Before running them: a peer that finishes first and submits its next op must
            # not take this rank's consumed bits for queued ones (an empty cycle).
            self.native.publish_queued(len(bit_pending))
            units += [[_response_for(by_id[c], reqs[c]) for c in unit]
                      for unit in coord._fuse(ready)]
        if not units:
            return
        local = eng._local
        if timeline.active() is not None:  # agreed: QUEUE from here
            timeline.cycle()
            for unit in units:
                for resp in unit:
                    if resp.error is None:
                        for name in resp.names:
                            if name in local:
                                timeline.op_agreed(resp.kind, name)
        try:
            for unit in units:
                eng.executor.run_unit(unit, local, eng._release_names)
        finally:
            for cid, req in list(self.bit_pending.items()):  # completed or failed above
                if local.get(req.name) is not req:
                    del self.bit_pending[cid]
            self.native.publish_queued(len(self.bit_pending))

    def _vote_and_run_one(self, nbits: int):
        """The vote, and the op with it when this rank's only queued op is one cached allreduce.

        The steady state of a synchronous training loop: one op queued, seen before. When the
        vote finds it ready on every rank and no rank with items, every rank runs just that
        allreduce next (the replicas agree on it), so the native call that votes runs it too
        and the op completes with no Python between the vote and the bytes. Returns _RAN
        then, the vote's (lengths, ready) when the cycle goes on as usual, or None when this
        cycle is not that case (more bits, replica work, a timeline, an op the executor
        cannot plan as one native call).
        """
        bit_pending, coord = self.bit_pending, self.coord
        if len(bit_pending) != 1 or coord.ready or timeline.active() is not None:
            return None
        ((cid, req),) = bit_pending.items()
        resp = coord.cache_by_id[cid].response
        if resp.kind != ALLREDUCE or req.pieces is not None:
            return None
        executor = self.engine.executor
        plan = executor.plan_allreduce(resp, req.array, req.inplace, req.out)
        if plan is None:
            return None
        transport, src, out, op, factor = plan
        voted = self.seg.agree_allreduce(cid, nbits, transport, src, out, op, factor)
        if voted is not None:
            req.out = out  # (the cycle that runs it writes there: no second array)
            return voted
        del bit_pending[cid]  # the native call published this rank's queue as empty
        self._counts["ran_with_vote"] += 1
        eng = self.engine
        executor.complete_planned(resp, req, out, eng._local, eng._release_names)
        return _RAN

    def express(self, kind: str, name: str, array: np.ndarray, inplace: bool, op,
                postscale: float, root: int, wait_s: float):
        """A synchronous allreduce, allgather or broadcast of a cached op (or a small async
        op), from the thread that submits it (Engine.express holds the lock): no
        Request, Handle or queue when the peers are ready for it.

        When this rank has nothing else in flight and `name` is cached with this op's
        signature, one native call publishes the op as queued, waits up to `wait_s` for
        every peer to have ops queued too, and runs the cycle's vote and, when every rank
        is ready for just this op, the bytes (as _vote_and_run_one; a small allreduce
        travels with the vote itself). Returns the result then; a Handle
        when the op must wait after all (it is then pending as a cache bit, as submit()
        and prepare() leave it); None when this path does not apply (nothing was done).
        """
        eng, coord = self.engine, self.coord
        if (eng._queue or eng._local or eng._control or self.bit_pending or coord.ready
                or timeline.active() is not None or not self._bit_ok(name)):
            return None
        auto = name.__class__ is AutoName
        plan = self._express_plans.get((kind,) if auto else name)
        if (plan is None or plan.kind is not kind or array.dtype is not plan.dtype
                or array.shape != plan.shape or op != plan.op or postscale != plan.postscale
                or root != plan.root):
            plan = self._express_plan(kind, name, array, inplace, op, postscale, root)
            if plan is None:
                return None
        nbits = self._vote_slots()
        if kind is ALLREDUCE:
            out = array if inplace else buffers.empty_like(array)
            voted = self.seg.express_allreduce(plan.cid, nbits, wait_s, plan.transport,
                                               array, out, *plan.args)
        elif kind is ALLGATHER:
            out = buffers.empty(plan.out_shape, array.dtype)
            voted = self.seg.express_allgather(plan.cid, nbits, wait_s, plan.transport,
                                               array, out, *plan.args)
        else:  # BROADCAST
            out = eng.executor.broadcast_output(array, inplace, root)
            voted = self.seg.express_broadcast(plan.cid, nbits, wait_s, plan.transport, out,
                                               *plan.args)
        if voted is not False:
            self.last_cycle = time.monotonic()
        if voted is None:
            stats = self._counts
            stats["cycles"] += 1
            stats["ran_with_vote"] += 1
            stats["express"] += 1
            eng.executor.count_planned(kind)
            return out
        return self._express_waits(kind, name, array, inplace, out, plan, voted)

    def express_resumed(self, kind: str, name: str, array: np.ndarray, inplace: bool,
                        out: np.ndarray, voted, error):
        """The rest of an op the express table started and did not finish (the lock held):
        what express() does after its native call. `out` is the result array that call made,
        `voted` its answer (False, or the vote's), `error` the message it failed with, or
        None."""
        if error is not None:
            raise TransportError(error)
        if voted is not False:
            self.last_cycle = time.monotonic()
        plan = self._express_plans[(kind,) if name.__class__ is AutoName else name]
        return self._express_waits(kind, name, array, inplace, out, plan, voted)

    def _express_waits(self, kind: str, name: str, array: np.ndarray, inplace: bool,
                       out: np.ndarray, plan: _ExpressPlan, voted) -> Handle:
        """An express op that did not run at once: it waits as this rank's cache bit, as if
        submitted, with `out` (made for it already) as its result array; its Handle."""
        eng = self.engine
        req = Request(name=name, kind=kind, array=array, inplace=inplace,
                      signature=plan.sig, handle=Handle(name), out=out,
                      named=name.__class__ is not AutoName)
        req.handle.engine = eng
        with eng._cv:
            eng._names_in_flight.add(name)
        req.sent_at = time.monotonic()
        eng._local[name] = req
        self.bit_pending[plan.cid] = req
        if voted is False:  # the peers did not queue it yet: as prepare() leaves a new bit
            self.news = True
        else:  # the peers are in this cycle: finish it
            self.news = False
            self._counts["cycles"] += 1
            self._after_vote(b"", *voted)
        return req.handle

    def _express_plan(self, kind: str, name: str, array: np.ndarray, inplace: bool, op,
                      postscale: float, root: int):
        """The _ExpressPlan of a cached op, worked out once per name (and again when the
        array or the op change); None when the op is not cached with this signature or
        has no single native call (see Executor.plan_allreduce)."""
        coord = self.coord
        sig = signature(kind, array, op=op, postscale=postscale, root=root)
        # (an unnamed op: nothing is in flight here, so it is the oldest unnamed one)
        cid = self._cache_id_of(name, sig)
        if cid is None:
            return None
        resp = coord.cache_by_id[cid].response
        executor = self.engine.executor
        if kind is ALLREDUCE:
            # (only the plan is wanted here: `array` stands in for the output array)
            planned = executor.plan_allreduce(resp, array, inplace, out=array)
            if planned is None or not hasattr(planned[0], "express_allreduce"):
                return None
            transport, _, _, transport_op, factor = planned
            plan = _ExpressPlan(kind, cid, sig, array, op, postscale, root, transport,
                                (dtype_code(array.dtype), op_code(transport_op), factor))
        else:
            transport = executor.choose(resp.device, kind)
            if resp.device != "cpu" or not hasattr(transport, "express_" + kind):
                if name.__class__ is str:
                    self.express_table.forget(name)  # (another kind's plan of this name)
                return None
            if kind is ALLGATHER:
                rows, inner = resp.first_dims[0], tuple(resp.shapes[0])
                row_bytes = math.prod(inner) * array.dtype.itemsize
                plan = _ExpressPlan(kind, cid, sig, array, op, postscale, root, transport,
                                    ([r * row_bytes for r in rows],), (sum(rows),) + inner)
            else:
                plan = _ExpressPlan(kind, cid, sig, array, op, postscale, root, transport,
                                    (array.nbytes, resp.root))
        # the native table runs it from now on (an unnamed op's plan: under None)
        if name.__class__ is str or name.__class__ is AutoName:
            key = None if name.__class__ is AutoName else name
            data = self.seg._native_of(plan.transport)
            table = self.express_table
            if kind is ALLREDUCE:
                table.enter(key, cid, array.dtype, array.shape, op, postscale, data, *plan.args)
            elif kind is ALLGATHER:
                table.enter_allgather(key, cid, array.dtype, array.shape, data, *plan.args,
                                      plan.out_shape)
            else:
                table.enter_broadcast(key, cid, array.dtype, array.shape, data, root,
                                      root == self.engine.rank)
        self._express_plans[(kind,) if name.__class__ is AutoName else name] = plan
        return plan

    def abort_reason(self) -> str:
        """Why the segment was aborted, naming the rank; "" when it was not (or is closed)."""
        try:
            return self.native.abort_reason()
        except RuntimeError:  # (ShmError: closed)
            return ""

    def abort(self, reason: str) -> None:
        """Fail every peer's wait on this segment with `reason` (this rank's runtime stopped)."""
        self.seg.abort(reason)

    def close(self, reason: str) -> None:
        """Release peers that wait in a cycle for this rank, then unmap the segment."""
        self.express_table.close()
        self.seg.abort(reason)
        self.seg.close()
