"""TorchState: a model, an optimizer, samplers and plain values, committed and synced together."""
from __future__ import annotations

import copy

import torch

from nbdist.common.elastic import ObjectState

from ..functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from nbdist.common import rank
from .sampler import ElasticSampler


class _Handler:
    """Save / restore / sync one framework object (the value stays the user's object)."""

    def __init__(self, value):
        self.value = value
        self.save()

    def set_value(self, value) -> None:
        self.value = value
        self.save()


class _ModelHandler(_Handler):
    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self) -> None:
        # load_state_dict also reshards the epoch's remaining samples for the current world.
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=0))


_HANDLERS = [(torch.nn.Module, _ModelHandler), (torch.optim.Optimizer, _OptimizerHandler),
             (ElasticSampler, _SamplerHandler)]


class TorchState(ObjectState):
    """Horovod's TorchState: `model=`, `optimizer=` and any other keyword (samplers, epoch,
    batch, ...) become attributes; commit() saves all of them on every rank."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handlers, plain = {}, {}
        for name, value in kwargs.items():
            kind = next((h for t, h in _HANDLERS if isinstance(value, t)), None)
            if kind is not None:
                handlers[name] = kind(value)
            else:
                plain[name] = value
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def reset(self) -> None:
        # Samplers split the epoch's remaining samples over the new world (size and rank).
        for handler in self._handlers.values():
            if isinstance(handler, _SamplerHandler):
                handler.value.reset()

    def __setattr__(self, name, value):
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        super().__setattr__(name, value)
