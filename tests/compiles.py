"""Counting compilations by function name, through JAX's own monitoring events."""

from __future__ import annotations

import collections
import contextlib
import re
from collections.abc import Iterator

import jax

# Sent once per program XLA compiles (a persistent-cache hit included: it is still a miss of
# the jitted function's own cache), with fun_name="jit(<function name>)".
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_WRAPPED = re.compile(r"^\w+\((?P<name>.*)\)$")


def _function_name(fun_name: str) -> str:
    match = _WRAPPED.match(fun_name)
    return match["name"] if match else fun_name


@contextlib.contextmanager
def count_compiles() -> Iterator[collections.Counter]:
    """A Counter of the programs compiled inside the block, by function name:

        with count_compiles() as compiles:
            rollout(...)
        assert compiles["_rollout"] == 1

    A function named `f` counts under "f" (whatever transformation, "jit(f)" or "pmap(f)",
    compiled it); a name that never compiled counts 0.
    """
    counts: collections.Counter = collections.Counter()

    def listen(event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            counts[_function_name(str(kwargs.get("fun_name", "")))] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
