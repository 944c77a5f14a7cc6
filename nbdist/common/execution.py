"""Runs agreed units on this rank: fusion buffers, scaling, and the transport calls.

Every rank runs the same units in the same order (the coordinator's), so the
transport collectives line up. A rank that joined has no request for an op and
takes part with zeros (allreduce) or no rows (allgather), as Horovod does.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from . import buffers, timeline
from .ops_base import ReduceOp, is_half, numpy_dtype
from .requests import (ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, JOIN,
                       REDUCESCATTER, Request, Response, make_error)


# A response's op (an int) -> what the transport reduces with: Average sums, then divides.
_TRANSPORT_OPS = {int(op): op for op in ReduceOp}
_TRANSPORT_OPS[int(ReduceOp.Average)] = ReduceOp.Sum


def reducescatter_counts(rows: int, size: int) -> list[int]:
    """Rows of the first dimension each rank keeps: the first `rows % size` get one more."""
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


class Executor:
    """Turns responses into transport calls for one rank, and completes its handles."""

    def __init__(self, rank: int, size: int, choose: Callable[[str, str], object]):
        self.rank = rank
        self.size = size
        self.choose = choose  # (device, kind) -> Transport
        self._fusion: dict[str, np.ndarray] = {}
        # counters for tests and `nbdist bench`: how often fusion happened (see stats)
        self._counts = {"allreduce_ops": 0, "allreduce_units": 0, "units": 0}
        # () -> (ops, of which allreduces) run as units of their own outside this
        # executor, counted in stats too (the shm agreement's express table: ShmAgreement)
        self.counted_elsewhere: Callable[[], tuple[int, int]] | None = None

    @property
    def stats(self) -> dict[str, int]:
        """The counters: allreduce ops, allreduce units (fused or not), units of any kind."""
        stats = dict(self._counts)
        if self.counted_elsewhere is not None:
            ran, allreduces = self.counted_elsewhere()
            stats["units"] += ran
            stats["allreduce_ops"] += allreduces
            stats["allreduce_units"] += allreduces
        return stats

    # -- helpers -----------------------------------------------------------------------
    def _fusion_buffer(self, dtype: np.dtype, elements: int) -> np.ndarray:
        """A reusable flat buffer per dtype, grown as needed (fusion of small allreduces)."""
        buf = self._fusion.get(dtype.str + dtype.name)
        if buf is None or buf.size < elements:
            buf = np.empty(max(elements, 1024), dtype)
            self._fusion[dtype.str + dtype.name] = buf
        return buf[:elements]

    @staticmethod
    def _scale(buf: np.ndarray, factor: float) -> None:
        """Multiply in place as Horovod's CPU ops do: integers in float64 (truncating back),
        16-bit floats in float32 (the factor is not rounded to 16 bits), others in their dtype."""
        if factor == 1.0 or buf.size == 0:
            return
        if buf.dtype.kind in "iu":
            np.multiply(buf, np.float64(factor), out=buf, casting="unsafe")
        elif is_half(buf.dtype):
            np.multiply(buf, np.float32(factor), out=buf, casting="unsafe")
        else:
            buf *= buf.dtype.type(factor)

    def _finish_reduction(self, buf: np.ndarray, resp: Response) -> None:
        post = resp.postscale
        if resp.op == ReduceOp.Average:
            if buf.dtype.kind in "iu":
                if post != 1.0:  # Horovod: one float64 multiply by post/size, truncated
                    self._scale(buf, post / self.size)
                    return
                # exact integer division rounding toward zero (Horovod truncates)
                quotient = np.floor_divide(buf, self.size)
                if buf.dtype.kind == "i":
                    quotient += (buf < 0) & (quotient * self.size != buf)
                buf[...] = quotient
                return
            post = post / self.size
        self._scale(buf, post)

    def _native_factor(self, resp: Response, dtype: np.dtype) -> float | None:
        """The multiply that finishes `resp`'s reduction when the native call can do it (float32
        and float64: one multiply in their own type, as _finish_reduction), 1.0 when there is
        nothing to finish, else None (integer Average, 16-bit floats: _finish_reduction)."""
        post = resp.postscale
        if resp.op == ReduceOp.Average:
            post = post / self.size
        elif post == 1.0:
            return 1.0
        return post if dtype.char in "fd" else None

    def plan_allreduce(self, resp: Response, array: np.ndarray, inplace: bool,
                       out: np.ndarray | None = None) -> tuple | None:
        """How this rank runs `resp`, a unit of its own over `array`, as one native
        allreduce_into: (transport, input, output, transport op, factor); None when it needs
        the general path (a GPU buffer, a prescale, a transport without allreduce_into,
        Python-side scaling). The output of an out-of-place op is `out` when given (see
        Request.out), else a new array."""
        if resp.device != "cpu" or resp.prescale != 1.0:
            return None
        transport = self.choose("cpu", ALLREDUCE)
        if not hasattr(transport, "allreduce_into"):
            return None
        factor = self._native_factor(resp, array.dtype)
        if factor is None:
            return None
        if inplace:
            out = array
        elif out is None:
            out = buffers.empty_like(array)
        return transport, array, out, self._transport_op(resp.op), factor

    def complete_planned(self, resp: Response, req: Request, out: np.ndarray,
                         local: dict[str, Request],
                         release: Callable[[list[str]], None]) -> None:
        """A planned allreduce ran (agreement.py ran it in the vote's native call): complete it
        as run_unit would have."""
        del local[req.name]
        release([req.name])
        self.count_planned()
        req.handle.set_result(out)

    def count_planned(self, kind: str = ALLREDUCE) -> None:
        """The stats of one op (a unit of its own) that ran outside run_unit."""
        stats = self._counts
        stats["units"] += 1
        if kind is ALLREDUCE:
            stats["allreduce_ops"] += 1
            stats["allreduce_units"] += 1

    @staticmethod
    def _traced(kind: str, reqs, phase: str):
        """The names to mark `phase` on (only when a timeline runs; else None)."""
        if timeline.active() is None:
            return None
        names = [req.name for req in reqs if req is not None]
        timeline.phase_begin(kind, names, phase)
        return names

    @staticmethod
    def _transport_phase(transport, kind: str) -> str:
        return f"{getattr(transport, 'name', 'transport').upper()}_{kind.upper()}"

    @staticmethod
    def _transport_op(op: int) -> ReduceOp:
        return _TRANSPORT_OPS[op]

    # -- entry point -------------------------------------------------------------------
    def run_unit(self, unit: list[Response], local: dict[str, Request],
                 release: Callable[[list[str]], None]) -> None:
        """Run one unit; complete (or fail) the local requests it names, removing them.

        `release(names)` runs before any handle completes, so a caller woken by its
        handle may submit the same name again at once (the next training step).
        """
        first = unit[0]
        if first.error is not None:
            failed = [(local.pop(name), resp) for resp in unit
                      if resp.targets is None or self.rank in resp.targets
                      for name in resp.names if name in local]
            release([req.name for req, _ in failed])
            for req, resp in failed:
                timeline.op_finished(req.kind, req.name)
                req.handle.set_error(make_error(resp.error))
            return
        reqs = [local.pop(resp.names[0], None) for resp in unit]
        release([req.name for req in reqs if req is not None])
        traced = timeline.active() is not None
        if traced:
            for req in reqs:
                if req is not None:
                    timeline.op_started(req.kind, req.name)
        self._counts["units"] += 1
        if first.kind == ALLREDUCE:
            self._counts["allreduce_ops"] += len(unit)
            self._counts["allreduce_units"] += 1
        try:
            if first.kind == ALLREDUCE:
                self._allreduce(unit, reqs)
            elif first.kind == ALLGATHER:
                self._allgather(first, reqs[0])
            elif first.kind == BROADCAST:
                self._broadcast(first, reqs[0])
            elif first.kind == ALLTOALL:
                self._alltoall(first, reqs[0])
            elif first.kind == REDUCESCATTER:
                self._reducescatter(first, reqs[0])
            elif first.kind == BARRIER:
                if reqs[0] is not None:
                    reqs[0].handle.set_result(None)
            elif first.kind == JOIN:
                if reqs[0] is not None:
                    reqs[0].handle.set_result(first.last_joined)
            else:  # pragma: no cover - the coordinator only sends known kinds
                raise ValueError(f"unknown op kind {first.kind!r}")
        except BaseException:
            # A failure here (a peer died mid-transfer) breaks the runtime: every caller of
            # run_unit then fails all ops in flight with one RuntimeBrokenError naming the
            # cause (Engine._runtime_failed), a HorovodInternalError that elastic retries.
            # These ops go back among them, not failed here with the transport's own error.
            for req in reqs:
                if req is not None:
                    local[req.name] = req
            raise
        finally:
            if traced:
                for req in reqs:
                    if req is not None:
                        timeline.op_finished(req.kind, req.name)

    # -- the kinds -----------------------------------------------------------------------
    def _device_op(self, unit: list[Response], reqs: list[Request | None]) -> None:
        """GPU buffers: in place through NCCL, one op at a time; scaling with the array's own ops."""
        for resp, req in zip(unit, reqs):
            if req is None:
                raise RuntimeError(f"{resp.kind} '{resp.names[0]}' on a GPU cannot run "
                                   f"with joined ranks")
            buf = req.array
            transport = self.choose(resp.device, resp.kind)
            if resp.kind == BROADCAST:
                transport.broadcast(buf, resp.root)
            else:
                if resp.prescale != 1.0:
                    buf *= resp.prescale
                transport.allreduce(buf, self._transport_op(resp.op))
                post = resp.postscale
                if resp.op == ReduceOp.Average:
                    post /= self.size
                if post != 1.0:
                    buf *= post
            req.handle.set_result(buf)

    def _allreduce(self, unit: list[Response], reqs: list[Request | None]) -> None:
        first = unit[0]
        if first.device != "cpu":
            self._device_op(unit, reqs)
            return
        pieced = any(req is not None and req.pieces is not None for req in reqs)
        if len(unit) == 1 and reqs[0] is not None and not pieced:
            plan = self.plan_allreduce(first, reqs[0].array, reqs[0].inplace, reqs[0].out)
            if plan is not None:
                transport, src, out, op, factor = plan
                traced = self._traced(ALLREDUCE, reqs, self._transport_phase(transport, ALLREDUCE))
                transport.allreduce_into(src, out, op, factor)
                if traced:
                    timeline.phase_end(ALLREDUCE, traced, None)
                reqs[0].handle.set_result(out)
                return
        transport = self.choose(first.device, ALLREDUCE)
        op = self._transport_op(first.op)
        outputs: list = []
        for resp, req in zip(unit, reqs):
            if req is None:  # joined: contribute zeros of the agreed shape
                outputs.append(np.zeros(resp.shapes[0], numpy_dtype(first.dtype)))
            elif req.inplace:
                outputs.append(req.array)
            else:
                outputs.append(req.out if req.out is not None else buffers.empty_like(req.array))
        factor = (self._native_factor(first, outputs[0].dtype)
                  if first.prescale == 1.0 and hasattr(transport, "allreduce_pieces") else None)
        if factor is not None and (len(unit) > 1 or pieced):
            # The transport packs the pieces itself (into its segment when they fit; a unit
            # bigger than a slot chunk by chunk, straight from and into them).
            srcs: list = []
            dsts: list = []
            for out, req in zip(outputs, reqs):
                if req is not None and req.pieces is not None:
                    srcs += req.pieces
                    dsts += req.pieces
                else:
                    srcs.append(out if req is None or req.inplace else req.array)
                    dsts.append(out)
            traced = self._traced(ALLREDUCE, reqs, self._transport_phase(transport, ALLREDUCE))
            transport.allreduce_pieces(srcs, dsts, op, factor)
            if traced:
                timeline.phase_end(ALLREDUCE, traced, None)
            outputs = [req.pieces if req is not None and req.pieces is not None else out
                       for out, req in zip(outputs, reqs)]
        else:
            for req in reqs:  # pieces reduced as one array: packed into it (the result is there)
                if req is not None and req.pieces is not None:
                    np.concatenate([p.reshape(-1) for p in req.pieces], out=req.array)
            self._allreduce_arrays(unit, reqs, outputs, transport, op)
        for out, req in zip(outputs, reqs):
            if req is not None:
                req.handle.set_result(out)

    def _allreduce_arrays(self, unit: list[Response], reqs: list[Request | None],
                          outputs: list[np.ndarray], transport, op) -> None:
        """The reduction of a CPU unit into `outputs` (each request's own array for an
        in-place op): one array as it is, several through the fusion buffer."""
        first = unit[0]
        if len(unit) == 1:
            buf = outputs[0]
            req = reqs[0]
            if req is not None and not req.inplace:
                np.copyto(buf, req.array)
            flat = buf.reshape(-1)
            self._scale(flat, first.prescale)
            if timeline.active() is None:
                transport.allreduce(flat, op)
            else:
                phase = self._transport_phase(transport, ALLREDUCE)
                traced = self._traced(ALLREDUCE, reqs, phase)
                transport.allreduce(flat, op)
                timeline.phase_end(ALLREDUCE, traced, phase)
            self._finish_reduction(flat, first)
        else:
            total = sum(o.size for o in outputs)
            fused = self._fusion_buffer(numpy_dtype(first.dtype), total)
            traced = self._traced(ALLREDUCE, reqs, "MEMCPY_IN_FUSION_BUFFER")
            offset = 0
            for out, req in zip(outputs, reqs):
                src = out if req is None else req.array
                fused[offset:offset + out.size] = src.reshape(-1)
                offset += out.size
            self._scale(fused, first.prescale)
            phase = self._transport_phase(transport, ALLREDUCE)
            if traced:
                timeline.phase_end(ALLREDUCE, traced, "MEMCPY_IN_FUSION_BUFFER")
                timeline.phase_begin(ALLREDUCE, traced, phase)
            transport.allreduce(fused, op)
            self._finish_reduction(fused, first)
            if traced:
                timeline.phase_end(ALLREDUCE, traced, phase)
                timeline.phase_begin(ALLREDUCE, traced, "MEMCPY_OUT_FUSION_BUFFER")
            offset = 0
            for out in outputs:
                out.reshape(-1)[...] = fused[offset:offset + out.size]
                offset += out.size
            if traced:
                timeline.phase_end(ALLREDUCE, traced, "MEMCPY_OUT_FUSION_BUFFER")

    def _allgather(self, resp: Response, req: Request | None) -> None:
        dtype = numpy_dtype(resp.dtype)
        inner = resp.shapes[0]
        row = math.prod(inner)
        rows = resp.first_dims[0]
        shape = (sum(rows),) + tuple(inner)
        if req is not None and req.out is not None and req.out.shape == shape:
            recv = req.out
        else:
            recv = buffers.empty(shape, dtype)
        send = req.array if req is not None else np.empty((0,) + tuple(inner), dtype)
        transport = self.choose(resp.device, ALLGATHER)
        traced = self._traced(ALLGATHER, [req], self._transport_phase(transport, ALLGATHER))
        transport.allgatherv(
            np.ascontiguousarray(send).reshape(-1), recv.reshape(-1), [r * row for r in rows])
        if traced:
            timeline.phase_end(ALLGATHER, traced, None)
        if req is not None:
            req.handle.set_result(recv)

    def _broadcast(self, resp: Response, req: Request | None) -> None:
        if resp.device != "cpu":
            self._device_op([resp], [req])
            return
        if req is None:
            buf = np.empty(resp.shapes[0], numpy_dtype(resp.dtype))
        elif req.out is not None:
            buf = req.out
        else:
            buf = self.broadcast_output(req.array, req.inplace, resp.root)
        transport = self.choose(resp.device, BROADCAST)
        traced = self._traced(BROADCAST, [req], self._transport_phase(transport, BROADCAST))
        transport.broadcast(buf.reshape(-1), resp.root)
        if traced:
            timeline.phase_end(BROADCAST, traced, None)
        if req is not None:
            req.handle.set_result(buf)

    def broadcast_output(self, array: np.ndarray, inplace: bool, root: int) -> np.ndarray:
        """Where this rank's broadcast lands: `array` itself in place, else a new array
        (holding the input on the root, which sends it)."""
        if inplace:
            return array
        out = buffers.empty_like(array)
        if self.rank == root:
            np.copyto(out, array)
        return out

    def _alltoall(self, resp: Response, req: Request) -> None:
        dtype = numpy_dtype(resp.dtype)
        inner = tuple(resp.shapes[0])
        row = math.prod(inner)
        send_rows = resp.splits[self.rank]
        recv_rows = [resp.splits[src][self.rank] for src in range(self.size)]
        recv = buffers.empty((sum(recv_rows),) + inner, dtype)
        transport = self.choose(resp.device, ALLTOALL)
        traced = self._traced(ALLTOALL, [req], self._transport_phase(transport, ALLTOALL))
        transport.alltoallv(
            req.array.reshape(-1), [r * row for r in send_rows],
            recv.reshape(-1), [r * row for r in recv_rows])
        if traced:
            timeline.phase_end(ALLTOALL, traced, None)
        req.handle.set_result((recv, np.asarray(recv_rows, dtype=np.int32)))

    def _reducescatter(self, resp: Response, req: Request) -> None:
        shape = resp.shapes[0]
        inner = tuple(shape[1:])
        row = math.prod(inner)
        counts = reducescatter_counts(shape[0] if shape else 0, self.size)
        send = req.array.copy().reshape(-1)
        self._scale(send, resp.prescale)
        recv = np.empty((counts[self.rank],) + inner, req.array.dtype)
        transport = self.choose(resp.device, REDUCESCATTER)
        traced = self._traced(REDUCESCATTER, [req],
                              self._transport_phase(transport, REDUCESCATTER))
        transport.reducescatter(
            send, recv.reshape(-1), [c * row for c in counts], self._transport_op(resp.op))
        if traced:
            timeline.phase_end(REDUCESCATTER, traced, None)
        self._finish_reduction(recv.reshape(-1), resp)
        req.handle.set_result(recv)
