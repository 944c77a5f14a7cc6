"""The coordinator's bookkeeping: which named ops are ready on every rank, and what to run.

Pure Python with no MPI in it, so it can be unit-tested alone. Rank 0's engine
feeds it the requests of every rank (full signatures, or the id of a cached
response when a rank repeats a known op unchanged) and takes back, each cycle,
the units to run: lists of responses, where a list of several allreduces is one
fused buffer. Responses every rank has already seen travel as a bare cache id,
which makes the steady state of training (the same names every step) cheap.
"""
from __future__ import annotations

import time
from typing import Callable

from .requests import (ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, JOIN,
                       REDUCESCATTER, SIG_DEVICE, SIG_DTYPE, SIG_KIND, SIG_OP, SIG_POST,
                       SIG_PRE, SIG_ROOT, SIG_SHAPE, SIG_SPLITS, Response)
from .ops_base import ReduceOp

JOIN_NAME = "__nbdist.join__"
# How many signatures of unnamed ops the shm agreement's replicas keep as templates (the
# first ones seen): a loop's unnamed ops repeat a few shapes; changing ones go in full.
UNNAMED_TEMPLATES = 16
# What may run while some ranks have joined (Horovod): allreduce (joined ranks add zeros,
# Average still divides by the full size) and barrier. An allgather or broadcast would
# silently lose the joined ranks' data, so it fails on the ranks that submitted it.
KINDS_WITH_JOINED = {ALLREDUCE, BARRIER, JOIN}


def rank_list(ranks) -> str:
    """'rank 3' or 'ranks 0, 2-5': compact, for messages that must stay readable at 64 ranks."""
    from ..failure import rank_ranges  # the one rank-range formatter (no IPython in it)

    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + rank_ranges(ranks)


def describe_by_rank(values: dict[int, object]) -> str:
    """'rank 0: (3, 4); ranks 1-3: (4, 3)': ranks grouped by the value they had."""
    groups: dict[str, list[int]] = {}
    for r, v in sorted(values.items()):
        groups.setdefault(repr(v) if not isinstance(v, str) else v, []).append(r)
    return "; ".join(f"{rank_list(rs)}: {v}" for v, rs in groups.items())


class _Pending:
    """One op the coordinator has heard of from some ranks (a plain slotted class: one per op
    per step, on the hot path)."""

    __slots__ = ("name", "first_seen", "sigs", "cids", "named", "auto", "warned", "is_ready")

    def __init__(self, name: str, first_seen: float, named: bool = True, auto: bool = False):
        self.name = name
        self.first_seen = first_seen
        self.sigs: dict[int, tuple] = {}
        self.cids: dict[int, int] = {}
        self.named = named
        self.auto = auto  # an unnamed op (an AutoName)
        self.warned = False
        self.is_ready = False  # in Coordinator.ready


class _CacheEntry:
    """A cached response, with what fusion needs of it worked out once."""

    __slots__ = ("name", "sigs", "response", "fuse_key", "nbytes", "unnamed")

    def __init__(self, name: str, sigs: dict[int, tuple], response: Response,
                 unnamed: bool = False):
        self.name = name
        self.sigs = sigs
        self.response = response
        # The template of unnamed ops with these signatures (Coordinator.unnamed_cid): its
        # response names the op it was first agreed for; a rank renames it for each op.
        self.unnamed = unnamed
        self.fuse_key = _fuse_key(response)
        self.nbytes = response.nbytes() if self.fuse_key is not None else 0


def _fuse_key(resp: Response):
    """What allreduces must share to be fused into one buffer; None: this one runs alone."""
    if (resp.kind != ALLREDUCE or resp.error is not None or resp.joined
            or resp.device != "cpu"):  # GPU buffers are not fused (yet)
        return None
    return (resp.dtype, resp.op, resp.prescale, resp.postscale, resp.device)


def _mismatch(name: str, kind: str, what: str, values: dict[int, object]) -> tuple:
    return ("MismatchError",
            f"{kind} '{name}': ranks disagree on {what}: {describe_by_rank(values)}")


class Coordinator:
    """Rank 0's table of submitted ops; decides what runs, in one order for every rank."""

    def __init__(self, size: int, fusion_threshold: int, cache_capacity: int,
                 stall_warning_s: float, timeout_s: float,
                 warn: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic,
                 cache_unnamed: bool = False):
        self.size = size
        self.fusion_threshold = fusion_threshold
        self.cache_capacity = cache_capacity
        self.stall_warning_s = stall_warning_s
        self.timeout_s = timeout_s
        self.warn = warn
        self.clock = clock
        self.pending: dict[str, _Pending] = {}
        self.ready: list[str] = []
        self.joined: list[int] = []
        self.cache_by_id: dict[int, _CacheEntry] = {}
        self.cache_by_name: dict[str, int] = {}
        # Unnamed ops' templates (cache ids), with cache_unnamed (the shm agreement's replicas):
        # see unnamed_cid.
        self.cache_unnamed = cache_unnamed
        self.unnamed_cids: list[int] = []
        self.tombstones: dict[str, tuple[tuple, set[int]]] = {}
        self.epoch = 0

    # -- input -----------------------------------------------------------------------
    def add(self, rank: int, item) -> list[Response]:
        """Record one request of `rank`: a cache id, or (name, signature, named[, auto]).

        Returns error responses that must go out at once (an op already failed).
        """
        auto = False
        if item.__class__ is int:
            entry = self.cache_by_id[item]
            name, sig, named, cid = entry.name, entry.sigs[rank], True, item
        else:
            name, sig, named = item[0], item[1], item[2]
            auto = len(item) > 3 and item[3]
            cid = -1
        if self.tombstones:
            tomb = self.tombstones.get(name)
            if tomb is not None and rank in tomb[1]:
                tomb[1].discard(rank)
                if not tomb[1]:
                    del self.tombstones[name]
                return [Response(kind=sig[SIG_KIND], names=[name], error=tomb[0],
                                 targets=(rank,))]
        pending = self.pending.get(name)
        if pending is None:
            pending = self.pending[name] = _Pending(name, self.clock(), named, auto)
        sigs = pending.sigs
        if rank in sigs:  # the engine rejects local duplicates; this is a late one
            return [Response(kind=sig[SIG_KIND], names=[name], targets=(rank,), error=(
                "ValueError", f"{sig[SIG_KIND]} '{name}' was submitted twice by rank {rank} "
                "while in flight; give each in-flight op its own name"))]
        sigs[rank] = sig
        if not named:
            pending.named = False
        if cid >= 0:
            pending.cids[rank] = cid
        if sig[SIG_KIND] == JOIN:
            self.joined.append(rank)
            self._recheck_all()
        elif not self.joined:
            if len(sigs) == self.size and not pending.is_ready:  # common case: no sets built
                pending.is_ready = True
                self.ready.append(name)
        else:
            self._check_ready(pending)
        return []

    def abort(self) -> int:
        """Forget every op in flight (their ranks fail them); returns the new epoch."""
        self.pending.clear()
        self.ready.clear()
        self.joined.clear()
        self.tombstones.clear()
        self.epoch += 1
        return self.epoch

    # -- readiness ---------------------------------------------------------------------
    def _covered(self, pending: _Pending) -> bool:
        return len(pending.sigs.keys() | set(self.joined)) == self.size

    def _check_ready(self, pending: _Pending) -> None:
        if not pending.is_ready and self._covered(pending):
            pending.is_ready = True
            self.ready.append(pending.name)

    def _recheck_all(self) -> None:
        for pending in self.pending.values():
            self._check_ready(pending)

    def has_work(self) -> bool:
        """True while any op is known (so the engine keeps polling)."""
        return bool(self.pending)

    def has_ready(self) -> bool:
        return bool(self.ready)

    def partially_submitted(self) -> bool:
        """True when some op is submitted by some ranks but not all: more may come soon."""
        return len(self.pending) > len(self.ready)

    # -- output ------------------------------------------------------------------------
    def take_units(self) -> list[list]:
        """The ready ops as units to run in order; a unit of several allreduces is fused.

        Each element is a Response, or an int: the id of a cached response.
        """
        elements: list = []
        for name in self.ready:
            pending = self.pending.pop(name)
            elements.append(self._respond(pending))
        self.ready.clear()
        return self._fuse(elements)

    def _response_of(self, element) -> Response:
        return self.cache_by_id[element].response if isinstance(element, int) else element

    def _fuse(self, elements: list) -> list[list]:
        units: list[list] = []
        open_units: dict[tuple, list] = {}  # key -> [unit, bytes used]
        threshold = self.fusion_threshold
        cache_by_id = self.cache_by_id
        for element in elements:
            if element.__class__ is int:
                entry = cache_by_id[element]
                key, nbytes = entry.fuse_key, entry.nbytes
            else:
                key = _fuse_key(element)
                nbytes = element.nbytes() if key is not None else 0
            if key is None:
                units.append([element])
                continue
            slot = open_units.get(key)
            if slot is not None and slot[1] + nbytes <= threshold:
                slot[0].append(element)
                slot[1] += nbytes
            else:
                unit = [element]
                units.append(unit)
                open_units[key] = [unit, nbytes]
        return units

    def _respond(self, pending: _Pending):
        """Validate one complete op and build its response (or a cached id)."""
        name, sigs = pending.name, pending.sigs
        if (not self.joined and len(pending.cids) == self.size
                and len(set(pending.cids.values())) == 1):
            return next(iter(pending.cids.values()))
        first = next(iter(sigs.values()))
        kind = first[SIG_KIND]
        error = self._validate(name, kind, sigs)
        if error is not None:
            return Response(kind=kind, names=[name], error=error, targets=tuple(sorted(sigs)))
        resp = Response(kind=kind, names=[name], dtype=first[SIG_DTYPE], op=first[SIG_OP],
                        prescale=first[SIG_PRE], postscale=first[SIG_POST],
                        root=first[SIG_ROOT], device=first[SIG_DEVICE],
                        joined=tuple(sorted(set(self.joined) - set(sigs))))
        if kind == JOIN:
            resp.last_joined = self.joined[-1]
            self.joined.clear()
            return resp
        shape = first[SIG_SHAPE]
        if kind in (ALLGATHER, ALLTOALL):
            rows = [sigs[r][SIG_SHAPE][0] if r in sigs else 0 for r in range(self.size)]
            resp.first_dims = [rows]
            resp.shapes = [tuple(shape[1:])]
            if kind == ALLTOALL:
                resp.splits = [list(sigs[r][SIG_SPLITS]) for r in range(self.size)]
        else:
            resp.shapes = [shape] if shape is not None else []
        if resp.joined or self.cache_capacity <= len(self.cache_by_id):
            return resp
        if pending.named:
            cid = len(self.cache_by_id)
            resp.cache_id = cid
            self.cache_by_id[cid] = _CacheEntry(name, dict(sigs), resp)
            self.cache_by_name[name] = cid
        elif pending.auto and self.cache_unnamed and self._new_unnamed(sigs):
            cid = len(self.cache_by_id)
            self.cache_by_id[cid] = _CacheEntry(f"{kind}.noname", dict(sigs), resp, unnamed=True)
            self.unnamed_cids.append(cid)
        return resp

    def _new_unnamed(self, sigs: dict[int, tuple]) -> bool:
        """True when an unnamed op with these signatures may become a template: there is room
        (UNNAMED_TEMPLATES), and no template has any rank's signature already (so each rank's
        own signature names at most one template: unnamed_cid is unambiguous on every rank)."""
        if len(self.unnamed_cids) >= UNNAMED_TEMPLATES or len(sigs) != self.size:
            return False
        by_id = self.cache_by_id
        return not any(by_id[c].sigs.get(r) == s for c in self.unnamed_cids
                       for r, s in sigs.items())

    def unnamed_cid(self, rank: int, sig: tuple) -> int | None:
        """The template (cache id) of unnamed ops whose signature on `rank` is `sig`, or None.

        The shm agreement's cache bit of an unnamed op: a rank sets it for its oldest unnamed
        op in flight only. Ranks number unnamed ops in the order they submit them, and an op
        completes on every rank in the same cycle, so the ranks whose bits meet in a vote
        all hold the op of one number: the op is matched as its name would match it, without
        the name. (A rank that sends an op in full makes a peer that set the bit for it send
        it in full too: ShmAgreement.prepare.)"""
        by_id = self.cache_by_id
        for cid in self.unnamed_cids:
            if by_id[cid].sigs.get(rank) == sig:
                return cid
        return None

    def _validate(self, name: str, kind: str, sigs: dict[int, tuple]) -> tuple | None:
        """None when the ranks agree; else an error (class name, message) naming what differs."""

        def field_of(i, f=lambda v: v):
            return {r: f(s[i]) for r, s in sigs.items()}

        def differs(values: dict) -> bool:
            return len(set(values.values())) > 1

        kinds = field_of(SIG_KIND)
        if differs(kinds):
            return _mismatch(name, "op", "the kind of op", kinds)
        if self.joined and kind not in KINDS_WITH_JOINED:
            return ("CollectiveError", f"{kind} '{name}' cannot run while "
                    f"{rank_list(self.joined)} joined; only allreduce and barrier go on while a "
                    "rank has joined (as in Horovod)")
        if kind in (BARRIER, JOIN):
            return None
        checks = [("dtype", field_of(SIG_DTYPE)), ("device", field_of(SIG_DEVICE))]
        if kind in (ALLGATHER, ALLTOALL):
            checks.append(("the number of dimensions", field_of(SIG_SHAPE, len)))
            checks.append(("the shape after the first dimension",
                           field_of(SIG_SHAPE, lambda s: tuple(s[1:]))))
        else:
            checks.append(("shape", field_of(SIG_SHAPE)))
        if kind in (ALLREDUCE, REDUCESCATTER):
            checks.append(("the reduction op", field_of(SIG_OP, lambda o: ReduceOp(o).name)))
            checks.append(("prescale_factor", field_of(SIG_PRE)))
            checks.append(("postscale_factor", field_of(SIG_POST)))
        if kind == BROADCAST:
            checks.append(("the root rank", field_of(SIG_ROOT)))
        for what, values in checks:
            if differs(values):
                return _mismatch(name, kind, what, values)
        if kind == BROADCAST:
            root = next(iter(sigs.values()))[SIG_ROOT]
            if root in self.joined and root not in sigs:
                return ("CollectiveError",
                        f"broadcast '{name}': root rank {root} has joined and has no data")
        return None

    # -- stalls ------------------------------------------------------------------------
    def overdue(self) -> list[tuple[str, float]]:
        """Warn about stalled ops (as check_stalls does); return (name, age) of those past the
        timeout without failing them: the shm agreement sends these to every rank's replica
        (fail_stalled), so that one clock, rank 0's, decides for all."""
        now = self.clock()
        due = []
        everyone = set(range(self.size))
        for name, pending in self.pending.items():
            if pending.is_ready:
                continue
            age = now - pending.first_seen
            if self.stall_warning_s and age >= self.stall_warning_s and not pending.warned:
                pending.warned = True
                submitted = set(pending.sigs)
                kind = next(iter(pending.sigs.values()))[SIG_KIND]
                self.warn(f"nbdist: stall: {kind} '{name}' has waited {age:.0f} s: "
                          f"submitted by {rank_list(submitted)}, missing on "
                          f"{rank_list(everyone - submitted - set(self.joined))}"
                          + (f"; it fails after {self.timeout_s:g} s (NBDIST_TIMEOUT_S)"
                             if self.timeout_s else ""))
            if self.timeout_s and age >= self.timeout_s:
                due.append((name, age))
        return due

    def fail_stalled(self, name: str, age: float) -> list[Response]:
        """Fail one op that timed out (decided by overdue() on rank 0); [] if it is gone."""
        pending = self.pending.get(name)
        if pending is None or pending.is_ready:
            return []
        del self.pending[name]
        submitted = set(pending.sigs)
        missing = set(range(self.size)) - submitted - set(self.joined)
        kind = next(iter(pending.sigs.values()))[SIG_KIND]
        error = ("CollectiveTimeoutError",
                 f"{kind} '{name}' timed out after {age:.0f} s (NBDIST_TIMEOUT_S="
                 f"{self.timeout_s:g}): {rank_list(missing)} never submitted it "
                 f"({rank_list(submitted)} did)")
        if missing and len(self.tombstones) < 10000:
            self.tombstones[name] = (error, set(missing))
        return [Response(kind=kind, names=[name], error=error, targets=tuple(sorted(submitted)))]

    def check_stalls(self) -> list[Response]:
        """Warn about ops some ranks never submitted; fail them after the timeout."""
        now = self.clock()
        failed: list[Response] = []
        everyone = set(range(self.size))
        for name, pending in list(self.pending.items()):
            if pending.is_ready:
                continue
            age = now - pending.first_seen
            submitted = set(pending.sigs)
            missing = everyone - submitted - set(self.joined)
            kind = next(iter(pending.sigs.values()))[SIG_KIND]
            if self.stall_warning_s and age >= self.stall_warning_s and not pending.warned:
                pending.warned = True
                self.warn(f"nbdist: stall: {kind} '{name}' has waited {age:.0f} s: "
                          f"submitted by {rank_list(submitted)}, missing on {rank_list(missing)}"
                          + (f"; it fails after {self.timeout_s:g} s (NBDIST_TIMEOUT_S)"
                             if self.timeout_s else ""))
            if self.timeout_s and age >= self.timeout_s:
                del self.pending[name]
                error = ("CollectiveTimeoutError",
                         f"{kind} '{name}' timed out after {age:.0f} s (NBDIST_TIMEOUT_S="
                         f"{self.timeout_s:g}): {rank_list(missing)} never submitted it "
                         f"({rank_list(submitted)} did)")
                failed.append(Response(kind=kind, names=[name], error=error,
                                       targets=tuple(sorted(submitted))))
                if missing and len(self.tombstones) < 10000:
                    self.tombstones[name] = (error, set(missing))
        return failed
