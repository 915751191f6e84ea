"""What one compiled program computes and moves on one device, with every loop counted as
many times as it runs.

XLA's cost analysis (`Compiled.cost_analysis()`) adds a while loop's body to the program's
cost once, whatever its trip count: a `lax.scan` of ten matmuls reports one matmul. The
rollout is a scan over denoising steps and the transformers scan over their blocks, so read
directly it undercounts by the product of the trip counts. Here the compiled module is cut
into its while loops (the optimised HLO marks each with its `known_trip_count`), each loop's
body and condition are costed by XLA as modules of their own, and the whole is put back
together:

    total(c) = xla(c) + sum over loops w directly in c of
                   (n_w - 1) * (xla(body_w) + xla(cond_w)) + n_w * (total(body_w) - xla(body_w))

where xla(c) is XLA's cost of computation c (its loops once) and n_w the loop's trip count.
A loop whose trip count XLA does not know (a `fori_loop` with traced bounds) is counted as
one trip and listed (`unknown_loops`); `with_trips` gives the cost with those counts.
FLOPs, transcendentals and bytes accessed are all corrected the same way; the figures are
per device (the compiled module is one device's partition of the program).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
from jax._src.lib import xla_client

# A computation's first line in HLO text: `[ENTRY ]%name (params) -> shape {`.
_HEADER = re.compile(r"^(ENTRY )?%(\S+) \(.*\) -> .*\{$")
_WHILE = re.compile(r"\bwhile\(.*condition=%([\w.\-]+), body=%([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_REFERENCE = re.compile(r"%([\w.\-]+)")
FIGURES = ("flops", "transcendentals", "bytes accessed")


@dataclasses.dataclass(frozen=True)
class Loop:
    """A while loop of the program: where it sits, how often it runs per entry."""

    computation: str  # its body's name
    trips: int | None  # None: XLA does not know the trip count (counted as one trip)
    runs: int  # how many times the loop is entered over one call of the program
    per_trip: tuple[float, float, float]  # FIGURES of one more trip over all its runs


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """One call of a compiled program on one device."""

    flops: float
    transcendentals: float
    bytes_accessed: float
    xla_flops: float  # what `cost_analysis()` reports: every loop body counted once
    loops: tuple[Loop, ...] = ()

    @property
    def unknown_loops(self) -> tuple[Loop, ...]:
        """The loops whose trip count XLA does not know, in the order the program runs them
        (each counted as one trip)."""
        return tuple(loop for loop in self.loops if loop.trips is None)

    def with_trips(self, trips) -> ProgramCost:
        """The cost with the unknown loops' trip counts given, in their order; ValueError when
        the counts do not match those loops."""
        unknown = self.unknown_loops
        if len(trips) != len(unknown):
            raise ValueError(
                f"{len(trips)} trip counts given for the {len(unknown)} loops whose trip "
                "count XLA does not know."
            )
        extra = [
            sum((n - 1) * loop.per_trip[i] for n, loop in zip(trips, unknown)) for i in range(3)
        ]
        known = tuple(
            dataclasses.replace(loop, trips=n) if loop.trips is None else loop
            for loop, n in zip(self.loops, _fill(self.loops, trips))
        )
        return dataclasses.replace(
            self,
            flops=self.flops + extra[0],
            transcendentals=self.transcendentals + extra[1],
            bytes_accessed=self.bytes_accessed + extra[2],
            loops=known,
        )


def _fill(loops, trips):
    given = iter(trips)
    return [next(given) if loop.trips is None else loop.trips for loop in loops]


@dataclasses.dataclass(frozen=True)
class _Module:
    preamble: tuple[str, ...]  # what precedes the computations (stack frame tables)
    computations: dict[str, tuple[str, ...]]  # name -> its lines, ENTRY marker removed
    entry: str


def _parse(text: str) -> _Module:
    lines = text.splitlines()
    preamble: list[str] = []
    computations: dict[str, list[str]] = {}
    entry, current = None, None
    for line in lines[1:]:  # the first line is the module's own header
        header = _HEADER.match(line) if current is None else None
        if header:
            current = header.group(2)
            computations[current] = [line.removeprefix("ENTRY ")]
            entry = current if header.group(1) else entry
        elif current is not None:
            computations[current].append(line)
            current = None if line == "}" else current
        elif not computations:
            preamble.append(line)
    if entry is None:
        raise ValueError("the HLO text has no ENTRY computation.")
    return _Module(tuple(preamble), {k: tuple(v) for k, v in computations.items()}, entry)


def _references(module: _Module, name: str) -> list[str]:
    """The computations `name`'s instructions call, in order of first mention."""
    seen: dict[str, None] = {}
    for line in module.computations[name][1:]:
        for ref in _REFERENCE.findall(line):
            if ref in module.computations and ref != name:
                seen.setdefault(ref)
    return list(seen)


def _module_text(module: _Module, root: str) -> str:
    """The module with `root` as its entry and only the computations it reaches."""
    order, todo = [], [root]
    while todo:
        name = todo.pop()
        if name not in order:
            order.append(name)
            todo.extend(_references(module, name))
    blocks = []
    for name in reversed(order):  # callees before callers, as the parser wants them
        first, *rest = module.computations[name]
        blocks += [("ENTRY " if name == root else "") + first, *rest, ""]
    return "\n".join(["HloModule piece", *module.preamble, *blocks])


def _xla_cost(client, module: _Module, root: str) -> dict[str, float]:
    from jaxlib import _hlo

    hlo = _hlo.hlo_module_from_text(_module_text(module, root))
    cost = xla_client._xla.hlo_module_cost_analysis(client, hlo)
    return {k: float(cost.get(k, 0.0)) for k in FIGURES}


def _loops_in(module: _Module, name: str) -> list[tuple[str, str, int | None]]:
    """The while loops `name` runs directly (through calls, fusions and branches, not through
    another loop): (condition, body, trip count)."""
    found, seen, todo = [], set(), [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        inner: set[str] = set()
        for line in module.computations[current][1:]:
            loop = _WHILE.search(line)
            if loop:
                trips = _TRIP_COUNT.search(line)
                found.append((*loop.groups(), int(trips.group(1)) if trips else None))
                inner.update(loop.groups())
        todo.extend(r for r in _references(module, current) if r not in inner)
    return found


def hlo_cost(text: str, client=None) -> ProgramCost:
    """The loop-counted cost of the optimised HLO module `text` (`Compiled.as_text()`), costed
    by `client`'s backend (default: JAX's default backend)."""
    client = client if client is not None else jax.devices()[0].client
    module = _parse(text)
    xla = functools.lru_cache(maxsize=None)(lambda name: _xla_cost(client, module, name))
    loops: list[Loop] = []

    def total(name: str, runs: int) -> dict[str, float]:
        figures = dict(xla(name))
        for condition, body, trips in _loops_in(module, name):
            n = 1 if trips is None else trips
            inner = total(body, runs * n)
            # one trip: the body with its own loops counted, and the condition once more
            trip = {k: inner[k] + xla(condition)[k] for k in FIGURES}
            loops.append(Loop(body, trips, runs, tuple(trip[k] * runs for k in FIGURES)))
            for k in FIGURES:  # XLA counted the body and the condition once already
                figures[k] += n * trip[k] - xla(body)[k] - xla(condition)[k]
        return figures

    figures = total(module.entry, 1)
    return ProgramCost(
        flops=figures["flops"],
        transcendentals=figures["transcendentals"],
        bytes_accessed=figures["bytes accessed"],
        xla_flops=xla(module.entry)["flops"],
        loops=tuple(loops),
    )


def program_cost(compiled) -> ProgramCost:
    """The loop-counted cost of a `jax.stages.Compiled` program on one of its devices."""
    return hlo_cost(compiled.as_text())
