"""Placements per mesh axis, in DTensor's words: Shard(dim), Replicate(), Partial("sum"), and
StridedShard(dim, split_factor) (DTensor's _StridedShard).

`repr` is for machines (`Shard(dim=1)`), `str` the compact form plans and errors print (`S(1)`,
`R`, `P`, `_S(0, 2)`).  A Layout holds the same information per tensor axis; `placements_of` converts.

Several Shard(d) of one tensor axis d shard it over those mesh axes in the mesh's order, the
first outermost (DTensor's left-to-right sharding).  A tensor axis sharded over mesh axes in
another order (JAX's `P(("tp", "dp"))` on a ("dp", "tp") mesh: tp outermost) is a StridedShard
on the mesh axis that a later one (in mesh order) is outside of, as DTensor writes FSDP2 over TP:
[StridedShard(0, split_factor=2), Shard(0)].  So placements convert back to the same layout.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


class PartitionSpec(tuple):
    """JAX's PartitionSpec (`sf.P`): one entry per tensor axis, None (replicated), a mesh axis name
    or a tuple of them (outermost first); missing trailing entries are None.  A plain tuple is read
    as the same spec; P(...) says it is one where a tuple could also be a pytree of shardings
    (`in_shardings=((None, None),)` of a pair is two leaves as they come, `(P(None, None),)` one
    replicated matrix)."""

    def __new__(cls, *entries):
        return super().__new__(cls, entries)

    def __getnewargs__(self):  # (pickle and copy: the entries, not one tuple of them)
        return tuple(self)

    def __repr__(self):
        return f"P({', '.join(map(repr, self))})"


@dataclass(frozen=True)
class Shard:
    dim: int

    def __str__(self):
        return f"S({self.dim})"


@dataclass(frozen=True)
class StridedShard(Shard):
    """Shard(dim) on a mesh axis that later mesh axes (in the mesh's order) shard `dim` outside of:
    the axis is cut into split_factor x (this mesh axis' size) chunks and a device takes its
    chunk of each group of them (DTensor's _StridedShard; split_factor: the product of the sizes of
    those later mesh axes)."""
    split_factor: int = 1

    def __str__(self):
        return f"_S({self.dim}, {self.split_factor})"


@dataclass(frozen=True)
class Replicate:
    def __str__(self):
        return "R"


@dataclass(frozen=True)
class Partial:
    reduce_op: str = "sum"

    def __str__(self):
        return "P"


def placements_of(layout, mesh) -> tuple:
    """One placement per axis of the mesh the value lives on (`mesh`: the program's), in its order."""
    return layout.sharding(mesh).placements()


_COMPACT = re.compile(r"^(?:(R)|(P)|S\((-?\d+)\)|_S\((-?\d+), *(\d+)\))$")


def from_compact(text: str):
    """The placement a compact form names ('S(1)', 'R', 'P', '_S(0, 2)': what Layout.placements and
    sf.Array's repr print), else None."""
    m = _COMPACT.match(text)
    if m is None:
        return None
    if m[1]:
        return Replicate()
    if m[2]:
        return Partial()
    return Shard(int(m[3])) if m[3] is not None else StridedShard(int(m[4]), int(m[5]))
