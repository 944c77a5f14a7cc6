"""DistributedOptimizer: averages gradients across ranks while the backward pass runs.

A hook on each parameter fires once its gradient is fully accumulated and submits an
async in-place allreduce, so communication overlaps the rest of the backward pass;
step() (or synchronize()) waits for all of them before the wrapped optimizer updates the
parameters. As in Horovod, the returned object is an instance of a subclass of the
wrapped optimizer's class, sharing its state and param_groups.

Gradients go in buckets, as DDP's: the first step reduces each gradient on its own and
records the order in which the hooks fire; then rank 0's order, cut into buckets of
NBDIST_BUCKET_BYTES (25 MiB), is the layout on every rank. A bucket is one flat
allreduce, submitted when its last gradient is ready: one agreement cycle for many small
gradients instead of one each (a ResNet has ~40), which is what the per-op cost is about.
"""
from __future__ import annotations

import itertools
import warnings
import weakref
from contextlib import contextmanager

import torch

from nbdist import common as _c
from nbdist.common import world as _world
from nbdist.common.autotune import SizeTuner, agree_by
from nbdist.common.sizes import MiB

from .compression import Compression
from .mpi_ops import (Adasum, Average, _SparseHandle, allreduce_async_,
                      allreduce_pieces_async_, grouped_allreduce_async_,
                      sparse_allreduce_async, synchronize)
from .process_sets import check_process_set, global_process_set

_instances = itertools.count()  # numbers unnamed optimizers, so two never share op names
_classes: dict = {}  # one distributed subclass per wrapped optimizer class
# Each hooked parameter carries a weak reference to the DistributedOptimizer whose hooks
# it has. In a notebook the cell that wraps the optimizer is often run again on the same
# model; the new optimizer then takes the parameters over, or the old hooks would submit
# every gradient twice.
_OWNER = "_nbdist_hooked_by"
# NBDIST_AUTOTUNE: bucket sizes tried besides the configured one; 0: one op per gradient
TUNED_BUCKET_BYTES = (25 * MiB, 4 * MiB, 1 * MiB, 0)


class _Bucket:
    """Gradients of one dtype and device reduced as one flat allreduce (a DDP bucket)."""

    __slots__ = ("params", "name", "ready", "flat", "dtype", "device", "numel")

    def __init__(self, params: list, name: str, dtype: torch.dtype, device: torch.device):
        self.params = tuple(params)
        self.name = name
        self.ready = 0  # members whose gradient is final this step
        self.dtype, self.device = dtype, device
        self.numel = sum(p.numel() for p in params)
        self.flat: torch.Tensor | None = None  # kept between steps: no allocation per step

    def buffer(self) -> torch.Tensor:
        if self.flat is None:
            self.flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        return self.flat


class _DistributedMixin:
    """The distributed behaviour, placed before the wrapped optimizer's class in the MRO."""

    def _nbdist_setup(self, named_parameters, compression, backward_passes_per_step, op,
                      gradient_predivide_factor, groups, sparse_as_dense,
                      process_set=global_process_set, bucket_bytes=None):
        self._compression = compression
        self._process_set = process_set
        self._densified: set = set()  # sparse gradients reduced dense this step
        self.backward_passes_per_step = int(backward_passes_per_step)
        if self.backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        self.op = op
        # Adasum combines each rank's own parameter update, not its gradient (Horovod's
        # _DistributedAdasumOptimizer): see _submit_adasum.
        self._adasum = op == Adasum
        self._starts: dict = {}  # Adasum: each parameter's value before this step's update
        self.gradient_predivide_factor = gradient_predivide_factor
        self._prescale, self._postscale = _c.ops.predivide_factors(
            op, gradient_predivide_factor, "DistributedOptimizer")
        self.sparse_as_dense = sparse_as_dense
        self._parameter_names = self._name_parameters(named_parameters)
        self._params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._requires_update = set(self._params)
        self._delay = {p: self.backward_passes_per_step for p in self._params}
        self._handles: dict = {}  # param or group tuple -> (handle, compression ctx)
        self._group_of: dict = {}
        self._group_ready: dict = {}
        self._synchronized = False
        self._should_synchronize = True
        self._hook_handles = []
        self._setup_groups(groups)
        # Buckets (see the module's docstring) are laid out after the first step, from the
        # hook order it records here. Not with explicit groups (the user chose the fusion)
        # nor with Adasum, whose result depends on how the gradients are split.
        config = _c.basics.config()
        self._bucket_bytes = config.bucket_bytes if bucket_bytes is None else int(bucket_bytes)
        self._bucketing = not self._group_of and op != Adasum and self._bucket_bytes > 0
        self._sparse: set = set()  # parameters whose gradients took the sparse path
        self._layout_order: tuple | None = None  # (names in rank 0's hook order, sparse names)
        self._tuner: SizeTuner | None = None
        self._drop_buckets()
        # One rank has nothing to average with: behave as the plain optimizer (as Horovod).
        # A rank outside the optimizer's process set trains alone (as in Horovod).
        self._active = (_c.process_sets.is_member(process_set)
                        and _c.process_sets.size_of(process_set) > 1)
        if self._active:
            self._register_hooks()
            if self._bucketing and config.autotune:
                self._tuner = SizeTuner(
                    "DistributedOptimizer bucket_bytes", self._bucket_bytes, TUNED_BUCKET_BYTES,
                    config.autotune_steps, config.autotune_warmup,
                    agree_by("DistributedOptimizer.autotune", process_set), config.autotune_log,
                    _c.process_sets.rank_in(process_set) == 0, zero_label="one op per gradient")
            elif config.autotune:  # accepted, and nothing to tune: say so
                why = ("explicit groups" if self._group_of else "Adasum" if op == Adasum
                       else "bucket_bytes=0")
                warnings.warn(f"NBDIST_AUTOTUNE: this DistributedOptimizer reduces without "
                              f"buckets ({why}), so it has no bucket size to tune; it runs "
                              "as configured", stacklevel=2)

    @property
    def autotune_scores(self) -> dict:
        """With NBDIST_AUTOTUNE: each bucket size tried so far -> the slowest rank's median
        seconds per step (nbdist extension; empty without autotune)."""
        return dict(self._tuner.scores) if self._tuner is not None else {}

    # ----------------------------------------------------------- set-up

    def _name_parameters(self, named_parameters) -> dict:
        all_params = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is None:
            instance = next(_instances)
            return {p: f"allreduce.noname.{instance}.{i}" for i, p in enumerate(all_params)}
        named = list(named_parameters)
        if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                             "usually produced by model.named_parameters().")
        seen, dups = set(), set()
        for name, _ in named:
            (dups if name in seen else seen).add(name)
        if dups:
            raise ValueError("Parameter names in named_parameters must be unique. "
                             f"Found duplicates: {', '.join(sorted(map(str, dups)))}")
        names = {p: f"allreduce.{name}" for name, p in named}
        unnamed = [p for p in all_params if p not in names]
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model parameters "
                             f"were not named ({len(unnamed)} of {len(all_params)}; shapes "
                             f"{[tuple(p.shape) for p in unnamed][:5]})")
        return names

    def _setup_groups(self, groups) -> None:
        if groups is None or groups == 0:
            return
        if isinstance(groups, int):
            if groups < 0:
                raise ValueError("groups should be a non-negative integer or a list of lists "
                                 "of torch.Tensor.")
            size, extra = divmod(len(self._params), groups)
            chunks, start = [], 0
            for i in range(groups):  # near-equal contiguous chunks, the first ones one larger
                end = start + size + (1 if i < extra else 0)
                chunks.append(self._params[start:end])
                start = end
        elif isinstance(groups, (list, tuple)):
            seen = set()
            chunks = []
            for group in groups:
                chunk = []
                for p in group:
                    if not isinstance(p, torch.Tensor):
                        raise ValueError("groups must consist of torch.Tensor.")
                    if p in seen:
                        raise ValueError("A parameter can only appear once in groups.")
                    seen.add(p)
                    if p in self._requires_update:
                        chunk.append(p)
                chunks.append(chunk)
        else:
            raise ValueError("groups should be a non-negative integer or a list of lists of "
                             "torch.Tensor.")
        for chunk in chunks:
            if not chunk:
                continue
            key = tuple(chunk)
            for p in chunk:
                self._group_of[p] = key
            self._group_ready[key] = 0

    def _register_hooks(self) -> None:
        owners = (getattr(p, _OWNER, lambda: None)() for p in self._params)
        previous = {id(o): o for o in owners
                    if o is not None and o is not self and o._hook_handles}
        for old in previous.values():
            warnings.warn(f"rank {_c.rank()}: a new DistributedOptimizer takes over parameters of "
                          "an earlier one, which stops averaging gradients (its hooks are "
                          "removed)", stacklevel=4)
            old.remove_hooks()
        for p in self._params:
            setattr(p, _OWNER, weakref.ref(self))
            if hasattr(p, "register_post_accumulate_grad_hook"):  # torch >= 2.1
                self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))
            else:  # older torch: the hook on the parameter's AccumulateGrad node
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                hook = self._make_hook(p)
                self._hook_handles.append(acc.register_hook(lambda *_, hook=hook, p=p: hook(p)))
                self._hook_handles.append(acc)  # keep the node alive, or its hook is lost

    def _make_hook(self, p):
        def hook(*_):
            if self._delay[p] <= 0:
                raise AssertionError(
                    f"rank {_c.rank()}: gradients were computed more than backward_passes_per_step"
                    f" ({self.backward_passes_per_step}) times before the call to step(). Increase"
                    " backward_passes_per_step to accumulate gradients locally.")
            self._delay[p] -= 1
            if self._delay[p] > 0:
                return
            if self._adasum:
                self._submit_adasum(p)
                return
            bucket = self._bucket_of.get(p)
            if bucket is not None and not self._layout_current():
                bucket = None
            if bucket is not None:
                bucket.ready += 1
                if bucket.ready == len(bucket.params):
                    self._submit_bucket(bucket)
                return
            group = self._group_of.get(p)
            if group is None:
                if self._hook_order is not None:
                    self._hook_order.append(p)
                self._submit(p)
                return
            self._group_ready[group] += 1
            if self._group_ready[group] == len(group):
                self._submit_group(group)
        return hook

    # ----------------------------------------------------------- reductions

    def _dense_grad(self, p) -> torch.Tensor:
        if p.grad is None:
            # This rank did not use p, but others may have: it still contributes (zeros).
            p.grad = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif p.grad.is_sparse:
            # sparse_as_dense: reduced dense, handed back sparse (an optimizer such as
            # SparseAdam accepts only sparse gradients), as Horovod does
            p.grad = p.grad.to_dense()
            self._densified.add(p)
        return p.grad

    def _submit(self, p) -> None:
        name = self._parameter_names[p]
        if p.grad is not None and p.grad.is_sparse and not self.sparse_as_dense:
            _c.ops.resolve_op(self.op, f"sparse gradient of {name}", kind=_c.ops.SPARSE)
            self._sparse.add(p)
            self._handles[p] = (sparse_allreduce_async(p.grad.coalesce(), name, self.op, self._process_set), None)
            return
        grad = self._dense_grad(p)
        compressed, ctx = self._compression.compress(grad)
        handle = allreduce_async_(compressed, name=name, op=self.op,
                                  prescale_factor=self._prescale, postscale_factor=self._postscale,
                                  process_set=self._process_set)
        self._handles[p] = (handle, (compressed, ctx))

    def _submit_adasum(self, p) -> None:
        """Horovod's Adasum optimizer: this rank's own update of p, combined by Adasum.

        The wrapped optimizer steps p alone on this rank's gradient (its momentum or Adam
        state stays this rank's own); p then holds the update (new - start), which is
        Adasum-reduced in place; step() sets p = start + the combined update. For plain SGD
        this equals Adasum of the gradients; with momentum or Adam it does not.
        """
        self._dense_grad(p)  # a rank that did not use p steps on zeros, as the others wait
        start = self._starts.get(p)
        if start is None:
            start = self._starts[p] = torch.empty_like(p, requires_grad=False)
        stashed = [group["params"] for group in self.param_groups]
        with torch.no_grad():
            start.copy_(p)
            try:
                for group in self.param_groups:
                    group["params"] = [p] if any(q is p for q in group["params"]) else []
                super().step()  # the wrapped optimizer's own step, on p only
            finally:
                for group, params in zip(self.param_groups, stashed):
                    group["params"] = params
            p.sub_(start)
        compressed, ctx = self._compression.compress(p.data)
        handle = allreduce_async_(compressed, name=self._parameter_names[p], op=Adasum,
                                  process_set=self._process_set)
        self._handles[p] = (handle, (compressed, ctx))

    def _apply_adasum(self) -> None:
        """step() with op=Adasum: wait for every parameter's combined update and apply it."""
        for p in self._params:
            if p not in self._handles:  # its hook did not fire: step it now (zeros if unused)
                self._submit_adasum(p)
        handles, self._handles = self._handles, {}
        error = None
        for p, (handle, (compressed, ctx)) in handles.items():
            start = self._starts[p]
            try:
                synchronize(handle)
                with torch.no_grad():
                    start.add_(self._compression.decompress(compressed, ctx).to(start.dtype))
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                error = error or exc
            with torch.no_grad():
                p.copy_(start)  # after a failure: the value before the step, not the update
        self._end_reduction(error)

    def _submit_group(self, group: tuple) -> None:
        grads = [self._dense_grad(p) for p in group]
        compressed, ctxs = zip(*[self._compression.compress(g) for g in grads])
        handle = grouped_allreduce_async_(list(compressed),
                                          name=f"grouped_{self._parameter_names[group[0]]}",
                                          op=self.op, prescale_factor=self._prescale,
                                          postscale_factor=self._postscale,
                                          process_set=self._process_set)
        self._handles[group] = (handle, list(zip(compressed, ctxs)))
        self._group_ready[group] = 0

    def _submit_bucket(self, bucket: _Bucket) -> None:
        grads = [self._dense_grad(p) for p in bucket.params]
        compressed, ctxs = zip(*[self._compression.compress(g) for g in grads])
        flat = bucket.buffer()
        if bucket.device.type == "cpu" and all(c.is_contiguous() for c in compressed):
            # reduced where the gradients are: no copy into the flat buffer and back
            handle = allreduce_pieces_async_(flat, compressed, bucket.name, self.op,
                                             self._prescale, self._postscale,
                                             self._process_set)
        else:
            torch.cat([c.reshape(-1) for c in compressed], out=flat)
            handle = allreduce_async_(flat, name=bucket.name, op=self.op,
                                      prescale_factor=self._prescale,
                                      postscale_factor=self._postscale,
                                      process_set=self._process_set)
        self._handles[bucket] = (handle, (compressed, ctxs))
        bucket.ready = 0

    def _unpack_bucket(self, bucket: _Bucket, in_pieces, sent) -> None:
        """The bucket's results into the gradients: from the tensors sent when they were
        reduced where they are (`in_pieces`; nothing to do without compression), else from
        the flat buffer."""
        compressed, ctxs = sent
        offset = 0
        flat = bucket.flat
        assert flat is not None
        for p, c, ctx in zip(bucket.params, compressed, ctxs):
            if in_pieces:
                self._write_back(p, c, ctx)
                continue
            n = p.grad.numel()
            p.grad.copy_(self._compression.decompress(flat[offset:offset + n].view(p.grad.shape),
                                                      ctx))
            offset += n

    def _layout_current(self) -> bool:
        """False (and the layout dropped) when an elastic world changed since it was laid out:
        the new ranks have none, so every rank starts again from a step of single gradients.

        Never while reductions are in flight (a world changes between steps, and the reset
        clears them): dropping the buckets they use would reduce their gradients twice."""
        if self._layout_generation == _world.generation() or self._handles:
            return True
        self._drop_buckets()
        return False

    def _drop_buckets(self) -> None:
        self._clear_layout()
        self._hook_order: list | None = [] if self._bucketing else None
        self._layout_order = None
        self._layout_generation = _world.generation()
        if self._tuner is not None:
            self._tuner.reset()

    def _clear_layout(self) -> None:
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict = {}

    def _build_buckets(self) -> None:
        """Lay the buckets out from rank 0's hook order of the first step (all ranks agree).

        The layout must be the same on every rank (a bucket's members are known only by
        its position in the flat buffer), so every rank takes rank 0's order; the ranks'
        orders are gathered rather than broadcast so that all of them see a disagreement
        the same way and keep reducing gradient by gradient.
        """
        # (a first step that failed and was retried recorded some hooks twice)
        order = list(dict.fromkeys(self._hook_order or []))
        self._hook_order = None
        seen = set(order)
        # parameters whose hook did not fire in the first step: DDP's default order
        order += [p for p in reversed(self._params) if p not in seen]
        self._layout_generation = _world.generation()
        names = self._parameter_names
        gathered = _c.allgather_object(([names[p] for p in order],
                                        sorted(names[p] for p in self._sparse)),
                                       name="DistributedOptimizer.bucket_order",
                                       process_set=self._process_set)
        reference = gathered[0][0]
        if any(sorted(o) != sorted(reference) for o, _ in gathered):
            return  # the ranks' parameters differ: their single ops report it by name
        sparse = {n for _, s in gathered for n in s}  # reduced as allgathers, never bucketed
        self._layout_order = (reference, sparse)
        self._lay_out()

    def _lay_out(self) -> None:
        """Cut the agreed order into buckets of the size in use (the autotuner's candidate
        or choice, else bucket_bytes; 0: none, one op per gradient)."""
        assert self._layout_order is not None
        reference, sparse = self._layout_order
        bucket_bytes = self._tuner.size if self._tuner is not None else self._bucket_bytes
        names = self._parameter_names
        self._clear_layout()
        by_name = {names[p]: p for p in self._params}
        open_buckets: dict = {}  # (dtype, device) -> [members, bytes]
        layouts = []
        for name in reference:
            p = by_name[name]
            if name in sparse:
                continue
            dtype = self._compression.compress(torch.empty(0, dtype=p.dtype))[0].dtype
            key = (dtype, p.device)
            size = p.numel() * dtype.itemsize
            members = open_buckets.get(key)
            if members is None or (members[0] and members[1] + size > bucket_bytes):
                members = open_buckets[key] = [[], 0]
                layouts.append((key, members))
            members[0].append(p)
            members[1] += size
        for (dtype, device), (params, _) in layouts:
            if len(params) < 2:  # one gradient alone goes as itself, with its own name
                continue
            bucket = _Bucket(params, f"{names[params[0]]}+{len(params) - 1}", dtype, device)
            self._buckets.append(bucket)
            for p in params:
                self._bucket_of[p] = bucket

    def _write_back(self, p, compressed, ctx) -> None:
        if compressed is not p.grad:  # compression sent a converted copy
            p.grad.copy_(self._compression.decompress(compressed, ctx))

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce; afterwards p.grad holds the averaged gradients.

        With op=Adasum there is nothing to wait for here, as in Horovod: step() applies the
        combined updates.
        """
        if not self._active or self._adasum:
            self._synchronized = True
            return
        self._layout_current()
        # Gradients whose last hook did not fire on this rank (unused parameters, or fewer
        # backward passes than backward_passes_per_step): reduce them now, with zeros where
        # there is no gradient, so ranks that did compute them are not left waiting.
        for p in self._params:
            key = self._bucket_of.get(p) or self._group_of.get(p, p)
            if key not in self._handles:
                if key is p:
                    self._submit(p)
                elif isinstance(key, _Bucket):
                    self._submit_bucket(key)
                else:
                    self._submit_group(key)
        handles, self._handles = self._handles, {}
        error = None
        for key, (handle, ctx) in handles.items():
            try:  # wait for every op, even after one failed, so none stays in flight
                if isinstance(handle, _SparseHandle):
                    key.grad = handle.wait().coalesce()
                else:
                    result = synchronize(handle)
                    if isinstance(key, _Bucket):
                        self._unpack_bucket(key, result is True, ctx)
                    elif isinstance(key, tuple):
                        for p, (compressed, c) in zip(key, ctx):
                            self._write_back(p, compressed, c)
                    else:
                        self._write_back(key, *ctx)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                error = error or exc
        self._end_reduction(error)
        if self._hook_order is not None:
            self._build_buckets()
        elif (self._tuner is not None and self._layout_order is not None
              and self._tuner.step_done()):
            self._lay_out()  # the next candidate, or the one chosen
        self._synchronized = True

    def _end_reduction(self, error: BaseException | None) -> None:
        """After a step's reductions: start counting passes again, hand the gradients
        reduced dense (sparse_as_dense) back sparse, and raise the first error."""
        self._reset_accumulation()
        densified, self._densified = self._densified, set()
        if error is not None:
            raise error
        for p in densified:
            p.grad = p.grad.to_sparse()

    def _reset_accumulation(self) -> None:
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        for g in self._group_ready:
            self._group_ready[g] = 0
        for bucket in self._buckets:
            bucket.ready = 0

    def _in_flight(self) -> int:
        return len(self._handles)

    @contextmanager
    def skip_synchronize(self):
        """Within this block step() does not synchronize (call synchronize() yourself first).

        For gradient clipping or GradScaler.unscale_ on the averaged gradients:
            loss.backward(); optimizer.synchronize(); clip_grad_norm_(...)
            with optimizer.skip_synchronize(): optimizer.step()
        """
        if self._adasum:
            raise AssertionError("Skipping synchronization is not supported when using the "
                                 "Adasum optimizer (it combines updates, not gradients).")
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes accumulate locally before gradients are averaged."""
        self.backward_passes_per_step = int(passes)
        self._reset_accumulation()

    # ----------------------------------------------------------- the optimizer interface

    def step(self, closure=None):
        if self._adasum and self._active:
            # The updates were computed in the hooks; combine and apply them (Horovod).
            loss = closure() if closure is not None else None
            self._apply_adasum()
            self._synchronized = False
            return loss
        if closure is not None and self._active:
            # The closure runs backward itself (LBFGS calls it several times): average the
            # gradients after each call, before the optimizer looks at them.
            if self._handles:
                self.synchronize()

            def averaging_closure():
                loss = closure()
                self.synchronize()
                return loss

            self._synchronized = False
            return super().step(averaging_closure)
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "  # noqa: B028
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.")
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    step.hooked = True  # the wrapped class's step already runs torch's optimizer hooks

    def zero_grad(self, set_to_none: bool = True):
        if self._handles:
            raise AssertionError(
                f"rank {_c.rank()}: optimizer.zero_grad() was called after loss.backward() but "
                f"before optimizer.step() or optimizer.synchronize(), while {len(self._handles)} "
                "gradient allreduce(s) are in flight. This is prohibited as it can cause a race "
                "condition; call step() or synchronize() first.")
        self._reset_accumulation()  # a fresh start also discards partly accumulated passes
        return super().zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict):
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        self._reset_accumulation()
        return super().load_state_dict(state_dict)

    def remove_hooks(self) -> None:
        """Detach this optimizer's gradient hooks from the parameters (nbdist extension)."""
        for h in self._hook_handles:
            if hasattr(h, "remove"):
                h.remove()
        self._hook_handles = []
        self._active = False


def _distributed_class(base: type) -> type:
    cls = _classes.get(base)
    if cls is None:
        cls = type(base.__name__, (_DistributedMixin, base),
                   {"__module__": __name__, "__qualname__": base.__qualname__})
        _classes[base] = cls
    return cls


def _has_sparse_params(optimizer) -> bool:
    """Whether any parameter is fed by a sparse gradient (known only once one exists)."""
    return any(p.grad is not None and p.grad.is_sparse
               for g in optimizer.param_groups for p in g["params"])


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set, bucket_bytes=None):
    """Wrap a torch.optim optimizer so that step() uses gradients averaged over all ranks.

    Horovod's signature and behaviour. `op=Adasum` combines each rank's own parameter
    update (the wrapped optimizer's step on its local gradient) with Adasum, as Horovod's
    Adasum optimizer does (CPU, power-of-2 ranks; see nbdist/common/adasum.py); `groups`
    and buckets do not apply to it. `groups` (an int, or
    a list of lists of parameters) allreduces each group as one fused op. `bucket_bytes`
    (an nbdist extension, as DDP's bucket_cap_mb; default NBDIST_BUCKET_BYTES, 25 MiB)
    caps the buckets the other gradients are reduced in; 0 reduces each on its own.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer expects a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    if _c.process_sets.is_member(process_set):
        check_process_set(process_set, "DistributedOptimizer")
    if op == Adasum and sparse_as_dense is False and _has_sparse_params(optimizer):
        raise NotImplementedError("DistributedOptimizer(op=Adasum) does not reduce sparse "
                                  "gradients; pass sparse_as_dense=True")
    _c.ops.predivide_factors(op, gradient_predivide_factor, "DistributedOptimizer")
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups`", DeprecationWarning,
                      stacklevel=2)
        if groups is None:
            groups = num_groups
    if not _c.is_initialized():
        raise ValueError("nbdist has not been initialized; call hvd.init() before "
                         "hvd.DistributedOptimizer(...)")
    cls = _distributed_class(type(optimizer))
    dist = cls.__new__(cls)
    # Share the wrapped optimizer's state, param_groups, defaults and hooks (not re-created,
    # so nothing set up by its constructor is lost); leave out instance-level patches of
    # step/zero_grad (an LR scheduler made earlier), which would bypass ours.
    dist.__dict__.update({k: v for k, v in optimizer.__dict__.items()
                          if k not in ("step", "zero_grad")})
    if bucket_bytes is not None and int(bucket_bytes) < 0:
        raise ValueError(f"bucket_bytes must be >= 0, got {bucket_bytes}")
    dist._nbdist_setup(named_parameters, compression, backward_passes_per_step, op,
                       gradient_predivide_factor, groups, sparse_as_dense, process_set,
                       bucket_bytes)
    return dist
