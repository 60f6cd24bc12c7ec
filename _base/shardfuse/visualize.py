"""sf.visualize_sharding(x): which device holds which block of a 1-D or 2-D global array, as text
in a terminal and as an HTML table in Jupyter (JAX's jax.debug.visualize_array_sharding)."""
from __future__ import annotations

import html

from shardfuse.pieces import Placed, device_index

PALETTE = ("#cfe2f3", "#d9ead3", "#fff2cc", "#f4cccc", "#d9d2e9", "#fce5cd", "#d0e0e3", "#ead1dc")


class ShardingPicture:
    """The blocks of a global array and the devices holding each (rows x columns of blocks)."""

    def __init__(self, shape, rows, cols, holders, title):
        self.shape, self.rows, self.cols, self.holders, self.title = shape, rows, cols, holders, title

    def cell(self, i, j) -> str:
        return ",".join(map(str, self.holders[i][j])) if self.holders[i][j] else "-"

    def __str__(self):
        width = max(len(self.cell(i, j)) for i in range(len(self.rows)) for j in range(len(self.cols))) + 2
        width = max(width, 5)
        line = "+" + "+".join("-" * width for _ in self.cols) + "+"
        out = [self.title, line]
        for i, (r0, r1) in enumerate(self.rows):
            out.append("|" + "|".join(self.cell(i, j).center(width) for j in range(len(self.cols))) + "|"
                       + f"  rows {r0}:{r1}")
            out.append(line)
        out.append(" " + " ".join(f"{c0}:{c1}".center(width) for c0, c1 in self.cols) + "   (columns; cells: devices)")
        return "\n".join(out)

    __repr__ = __str__

    def _repr_html_(self):
        cells = []
        for i, (r0, r1) in enumerate(self.rows):
            tds = []
            for j, (c0, c1) in enumerate(self.cols):
                ds = self.holders[i][j]
                color = PALETTE[ds[0] % len(PALETTE)] if ds else "#eeeeee"
                tip = f"rows {r0}:{r1}, columns {c0}:{c1}"
                tds.append(f'<td title="{tip}" style="background:{color};border:1px solid #888;padding:6px 12px;'
                           f'text-align:center">{html.escape(self.cell(i, j))}</td>')
            cells.append("<tr>" + "".join(tds) + "</tr>")
        return (f"<div><div style='font-family:monospace'>{html.escape(self.title)}</div>"
                f"<table style='border-collapse:collapse;font-family:monospace'>{''.join(cells)}</table>"
                "<div style='font-size:smaller'>each cell: the devices holding that block</div></div>")


def visualize_sharding(x) -> ShardingPicture:
    """Which device holds which block of `x` (an sf.Array of 1 or 2 axes).  print() it in a
    terminal; in Jupyter it shows as a table."""
    if not isinstance(x, Placed):
        raise TypeError(f"visualize_sharding takes an sf.Array, got {type(x).__name__}")
    if x.ndim not in (1, 2):
        raise ValueError(f"visualize_sharding draws arrays of 1 or 2 axes (as JAX's does), got shape {x.shape}")
    shape = x.shape if x.ndim == 2 else (1,) + x.shape
    mesh = x.sharding.home(x.mesh)
    pieces = {}
    for d in mesh.devices:
        idx = device_index(x.shape, x.sharding, x.mesh, d)
        if idx is None:
            continue
        idx = idx if x.ndim == 2 else (slice(0, 1),) + idx
        key = tuple((s.start or 0, s.stop if s.stop is not None else n) for s, n in zip(idx, shape))
        pieces.setdefault(key, []).append(d)
    rows = sorted({k[0] for k in pieces})
    cols = sorted({k[1] for k in pieces})
    holders = [[sorted(pieces.get((r, c), [])) for c in cols] for r in rows]
    title = (f"sf.Array{list(x.shape)} {x.dtype_name}, placements {x.sharding.placements(x.mesh)} on {mesh!r}")
    return ShardingPicture(shape, rows, cols, holders, title)
