"""Op names that are identical on every rank.

The runtime matches ops across ranks by name, so a name must not depend on anything
that can differ between ranks: not on a tf.function's uid (it counts traces), nor on
eager call order when the graph is known. Variables give the most stable names (a
Keras 3 variable's `path`, e.g. "sequential/dense/kernel"); graph tensors fall back to
their name inside the graph, as Horovod does.
"""
from __future__ import annotations

import re

import tensorflow as tf

_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-/]")


def clean(name: str) -> str:
    """A name with only characters the runtime and logs handle well."""
    return _UNSAFE.sub("_", name)


def variable_name(var) -> str:
    """A variable's stable name: Keras 3's path, else tf.Variable.name without ':0'."""
    path = getattr(var, "path", None)
    name = path if isinstance(path, str) and path else getattr(var, "name", None) or "var"
    if name.endswith(":0"):
        name = name[:-2]
    return clean(name)


def variable_names(variables) -> list[str]:
    """Stable, unique names for a list of variables (duplicates get their position)."""
    names = [variable_name(v) if v is not None else "none" for v in variables]
    seen: dict[str, int] = {}
    for n in names:
        seen[n] = seen.get(n, 0) + 1
    return [f"{n}#{i}" if seen[n] > 1 else n for i, n in enumerate(names)]


def default_name(kind: str, tensor, name: str | None) -> str | None:
    """The name to submit under: the user's, else (in a graph) one from the tensor's name.

    Eagerly, None lets the runtime number unnamed ops in call order, as Horovod does.
    """
    if name is not None:
        return clean(name)
    if tf.executing_eagerly():
        return None
    tensor_name = getattr(tensor, "name", None) or kind
    return clean(f"Horovod{kind}_{tensor_name}")


def derived(name: str | None, suffix: str) -> str | None:
    """A related op's name (e.g. the gradient of a named op); None stays None."""
    return None if name is None else f"{name}.{suffix}"


def gradient(name: str | None, dy, suffix: str = "grad") -> str | None:
    """The name of an op in the gradient of the op `name`, whose incoming gradient is `dy`.

    In a graph, the same op's gradient can be built more than once (tf.gradients called
    once per output, as Horovod's tests do) and all of them run in one Session.run; each
    build is named after its incoming gradient tensor, whose graph name is unique and the
    same on every rank. Eagerly a gradient runs at once: `name.suffix` is enough.
    """
    if name is None:
        return None
    dy_name = None if tf.executing_eagerly() else getattr(dy, "name", None)
    return derived(name, suffix) if not dy_name else clean(f"{name}.{suffix}.{dy_name}")
