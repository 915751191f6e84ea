"""Programs built once per process for equal settings.

A process may build the same run more than once: a resume after a failure, an evaluation
after training, a notebook's second `setup`, the tests' many small runs. JAX keeps what it
traced and compiled per jitted function object, so handing back the function already built
for equal settings spares a second trace, lowering and compile (or persistent-cache read).
Settings are compared by value; functions (the model's denoiser, an optimizer's update) by
identity, so a reloaded model builds its own.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from collections.abc import Callable, Hashable
from typing import Any

import jax


def settings_key(value) -> Hashable:
    """A hashable stand-in for `value`, equal for equal settings: dicts, lists and tuples by
    their items, `functools.partial` by its function and arguments, dataclass records by
    their fields, pytrees of shardings by their structure and leaves. Raises TypeError for
    a value it cannot compare."""
    if isinstance(value, dict):
        return (dict, tuple((k, settings_key(v)) for k, v in sorted(value.items())))
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return (type(value), tuple(settings_key(v) for v in value))
    if isinstance(value, functools.partial):
        return (
            functools.partial,
            value.func,
            settings_key(value.args),
            settings_key(value.keywords),
        )
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # by its fields, so that a record holding a partial or shardings compares by value
        fields = dataclasses.fields(value)
        return (type(value), tuple((f.name, settings_key(getattr(value, f.name))) for f in fields))
    if isinstance(value, jax.sharding.Sharding) or value is None:
        return value
    try:
        hash(value)
        return (type(value), value)
    except TypeError:
        leaves, treedef = jax.tree_util.tree_flatten(value)
        if not leaves or not all(isinstance(x, jax.sharding.Sharding) for x in leaves):
            raise
        return (treedef, tuple(leaves))


class Kept:
    """The last `size` things built, by the settings they were built from."""

    def __init__(self, size: int):
        self._size = size
        self._built: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, settings, build: Callable[[], Any]):
        """What `build()` returned for equal `settings` (see `settings_key`), else a fresh
        `build()`, kept; settings it cannot compare always build."""
        try:
            key = settings_key(settings)
        except TypeError:
            return build()
        with self._lock:
            if key in self._built:
                self._built.move_to_end(key)
                return self._built[key]
        built = build()
        with self._lock:
            self._built[key] = built
            while len(self._built) > self._size:
                self._built.popitem(last=False)
        return built
