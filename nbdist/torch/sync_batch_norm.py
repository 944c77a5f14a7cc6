"""SyncBatchNorm: batch normalization with statistics over the whole global batch.

Each rank computes its count, mean and sum of squared deviations per channel; one
allgather combines them exactly (Chan's parallel variance), so the result equals one
process's BatchNorm on the concatenated batch, even when ranks hold different batch
sizes. The backward pass sums the two per-channel gradient reductions over the ranks,
which makes the input gradient that of the sum of every rank's loss (as
torch.nn.SyncBatchNorm does); weight and bias gradients stay local, for the
DistributedOptimizer to average.
"""
from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from nbdist import common as _c

from .mpi_ops import Sum, _allgather_submit, _allreduce_submit, synchronize


def _channel_view(t: torch.Tensor, dims: int) -> torch.Tensor:
    """A per-channel vector shaped to broadcast against an input of `dims` dimensions."""
    return t.view(1, -1, *([1] * (dims - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum):
        dims = [0] + list(range(2, x.dim()))
        # Half-precision inputs accumulate their statistics in float32.
        xs = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        count = x.numel() // x.shape[1]
        if count:
            mean = xs.mean(dim=dims)
            m2 = ((xs - _channel_view(mean, x.dim())) ** 2).sum(dim=dims)
        else:
            mean = torch.zeros(x.shape[1], dtype=xs.dtype)
            m2 = torch.zeros_like(mean)
        local = torch.cat([torch.tensor([float(count)], dtype=xs.dtype), mean, m2]).unsqueeze(0)
        gathered = synchronize(_allgather_submit(local, None))  # [size, 1 + 2C]
        counts, means, m2s = gathered[:, :1], gathered[:, 1:1 + x.shape[1]], gathered[:, 1 + x.shape[1]:]
        total = counts.sum()
        if total <= 0:
            raise ValueError(f"SyncBatchNorm on rank {_c.rank()}: the global batch is empty")
        g_mean = (counts * means).sum(0) / total
        g_m2 = (m2s + counts * (means - g_mean) ** 2).sum(0)
        g_var = g_m2 / total  # biased: what normalizes the batch
        if running_mean is not None:
            unbiased = g_m2 / (total - 1) if total > 1 else g_var
            running_mean.mul_(1 - momentum).add_(g_mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        invstd = torch.rsqrt(g_var + eps)
        xhat = (xs - _channel_view(g_mean, x.dim())) * _channel_view(invstd, x.dim())
        y = xhat
        if weight is not None:
            y = y * _channel_view(weight.to(y.dtype), x.dim())
        if bias is not None:
            y = y + _channel_view(bias.to(y.dtype), x.dim())
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.total = total
        ctx.has_bias = bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        xhat, invstd, weight = ctx.saved_tensors
        dims = [0] + list(range(2, grad_y.dim()))
        dy = grad_y.to(xhat.dtype)
        sum_dy = dy.sum(dim=dims)
        sum_dy_xhat = (dy * xhat).sum(dim=dims)
        channels = sum_dy.shape[0]
        both = synchronize(_allreduce_submit(torch.cat([sum_dy, sum_dy_xhat]), None, Sum, 1.0, 1.0))
        g_sum_dy, g_sum_dy_xhat = both[:channels], both[channels:]
        scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
        nd = grad_y.dim()
        dx = _channel_view(scale, nd) * (
            dy - _channel_view(g_sum_dy / ctx.total, nd)
            - xhat * _channel_view(g_sum_dy_xhat / ctx.total, nd))
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(weight.dtype if weight is not None else dy.dtype) \
            if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx.to(grad_y.dtype), grad_weight, grad_bias, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics cover the batch of every rank (Horovod's name).

    A drop-in for nn.BatchNorm1d/2d/3d (any input of 2 or more dimensions, channels in
    dimension 1). In eval mode, or on one rank, it is plain batch normalization.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _run_bn(self, input):
        return torch.nn.functional.batch_norm(
            input, self.running_mean, self.running_var, self.weight, self.bias,
            self.training or not self.track_running_stats, self._momentum_factor(), self.eps)

    def _momentum_factor(self) -> float:
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            if self.momentum is None:  # cumulative moving average
                return 1.0 / float(self.num_batches_tracked)
        return 0.0 if self.momentum is None else self.momentum

    def forward(self, input):
        self._check_input_dim(input)
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        if not self.training or _c.size() == 1:
            # eval uses running statistics (or this rank's batch, as torch does): no sharing
            return self._run_bn(input)
        use_running = self.training and self.track_running_stats
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias,
            self.running_mean if use_running else None,
            self.running_var if use_running else None,
            self.eps, self._momentum_factor())

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module) -> torch.nn.Module:
        """Replace every BatchNorm layer in `module` with a SyncBatchNorm (nbdist extension)."""
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats)
            if module.affine:
                with torch.no_grad():
                    converted.weight = module.weight
                    converted.bias = module.bias
            if module.track_running_stats:
                converted.running_mean = module.running_mean
                converted.running_var = module.running_var
                converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child))
        return converted
