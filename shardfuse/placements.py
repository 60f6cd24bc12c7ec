"""Placements per mesh axis, in DTensor's words: Shard(dim), Replicate(), Partial("sum").

`repr` is for machines (`Shard(dim=1)`), `str` the compact form plans and errors print (`S(1)`,
`R`, `P`).  A Layout holds the same information per tensor axis; `placements_of` converts.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    dim: int

    def __str__(self):
        return f"S({self.dim})"


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
