"""DistributedOptimizer: averages gradients across ranks while the backward pass runs.

A hook on each parameter fires once its gradient is fully accumulated and submits an
async in-place allreduce of that gradient, so communication overlaps the rest of the
backward pass; step() (or synchronize()) waits for all of them before the wrapped
optimizer updates the parameters. As in Horovod, the returned object is an instance of
a subclass of the wrapped optimizer's class, sharing its state and param_groups.
"""
from __future__ import annotations

import itertools
import warnings
import weakref
from contextlib import contextmanager

import torch

from nbdist import common as _c

from .compression import Compression
from .mpi_ops import (Adasum, Average, allgather_async, allreduce_async_,
                      grouped_allreduce_async_, synchronize)
from .process_sets import check_process_set, global_process_set

_instances = itertools.count()  # numbers unnamed optimizers, so two never share op names
_classes: dict = {}  # one distributed subclass per wrapped optimizer class
# Each hooked parameter carries a weak reference to the DistributedOptimizer whose hooks
# it has. In a notebook the cell that wraps the optimizer is often run again on the same
# model; the new optimizer then takes the parameters over, or the old hooks would submit
# every gradient twice.
_OWNER = "_nbdist_hooked_by"


class _SparseHandle:
    """A sparse gradient's reduction: allgather of its indices and values (as Horovod)."""

    def __init__(self, grad: torch.Tensor, name: str, op, process_set=global_process_set):
        grad = grad.coalesce()
        self.shape, self.op, self.process_set = grad.shape, op, process_set
        self.indices = allgather_async(grad.indices().t().contiguous(), name=f"{name}.indices",
                                       process_set=process_set)
        self.values = allgather_async(grad.values().contiguous(), name=f"{name}.values",
                                      process_set=process_set)

    def wait(self) -> torch.Tensor:
        values = synchronize(self.values)
        indices = synchronize(self.indices).t()
        if self.op == Average:
            values = values / (self.process_set.size() if self.process_set is not None else _c.size())
        return torch.sparse_coo_tensor(indices, values, self.shape, check_invariants=True).coalesce()


class _DistributedMixin:
    """The distributed behaviour, placed before the wrapped optimizer's class in the MRO."""

    def _nbdist_setup(self, named_parameters, compression, backward_passes_per_step, op,
                      gradient_predivide_factor, groups, sparse_as_dense,
                      process_set=global_process_set):
        self._compression = compression
        self._process_set = process_set
        self._densified: set = set()  # sparse gradients reduced dense this step
        self.backward_passes_per_step = int(backward_passes_per_step)
        if self.backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        self.op = op
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
        # One rank has nothing to average with: behave as the plain optimizer (as Horovod).
        # A rank outside the optimizer's process set trains alone (as in Horovod).
        self._active = (_c.process_sets.is_member(process_set)
                        and _c.process_sets.size_of(process_set) > 1)
        if self._active:
            self._register_hooks()

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
            group = self._group_of.get(p)
            if group is None:
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
            self._handles[p] = (_SparseHandle(p.grad, name, self.op, self._process_set), None)
            return
        grad = self._dense_grad(p)
        compressed, ctx = self._compression.compress(grad)
        handle = allreduce_async_(compressed, name=name, op=self.op,
                                  prescale_factor=self._prescale, postscale_factor=self._postscale,
                                  process_set=self._process_set)
        self._handles[p] = (handle, (compressed, ctx))

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

    def _write_back(self, p, compressed, ctx) -> None:
        if compressed is not p.grad:  # compression sent a converted copy
            p.grad.copy_(self._compression.decompress(compressed, ctx))

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce; afterwards p.grad holds the averaged gradients."""
        if not self._active:
            self._synchronized = True
            return
        # Gradients whose last hook did not fire on this rank (unused parameters, or fewer
        # backward passes than backward_passes_per_step): reduce them now, with zeros where
        # there is no gradient, so ranks that did compute them are not left waiting.
        for p in self._params:
            key = self._group_of.get(p, p)
            if key not in self._handles:
                if key is p:
                    self._submit(p)
                else:
                    self._submit_group(key)
        handles, self._handles = self._handles, {}
        error = None
        for key, (handle, ctx) in handles.items():
            try:  # wait for every op, even after one failed, so none stays in flight
                if isinstance(handle, _SparseHandle):
                    key.grad = handle.wait()
                else:
                    synchronize(handle)
                    if isinstance(key, tuple):
                        for p, (compressed, c) in zip(key, ctx):
                            self._write_back(p, compressed, c)
                    else:
                        self._write_back(key, *ctx)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                error = error or exc
        self._reset_accumulation()
        densified, self._densified = self._densified, set()
        if error is None:
            for p in densified:
                p.grad = p.grad.to_sparse()
        if error is not None:
            raise error
        self._synchronized = True

    def _reset_accumulation(self) -> None:
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        for g in self._group_ready:
            self._group_ready[g] = 0

    def _in_flight(self) -> int:
        return len(self._handles)

    @contextmanager
    def skip_synchronize(self):
        """Within this block step() does not synchronize (call synchronize() yourself first).

        For gradient clipping or GradScaler.unscale_ on the averaged gradients:
            loss.backward(); optimizer.synchronize(); clip_grad_norm_(...)
            with optimizer.skip_synchronize(): optimizer.step()
        """
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
                         process_set=global_process_set):
    """Wrap a torch.optim optimizer so that step() uses gradients averaged over all ranks.

    Horovod's signature and behaviour. `op=Adasum` combines the ranks' gradients with
    Adasum (CPU, power-of-2 ranks; see nbdist/common/adasum.py); Horovod applies Adasum
    to each rank's parameter update instead, the same for plain SGD. `groups` (an int, or
    a list of lists of parameters) allreduces each group as one fused op.
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
    dist._nbdist_setup(named_parameters, compression, backward_passes_per_step, op,
                       gradient_predivide_factor, groups, sparse_as_dense, process_set)
    return dist
