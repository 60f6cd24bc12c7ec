"""Strides of local buffers, in elements: what the compiler (passes/contiguity.py, which stages
reshapes that cannot be views and collective buffers that are not contiguous) and the executor
(which binds views) both need."""
from __future__ import annotations


def contiguous_strides(shape):
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def reshape_strides(shape, strides, new_shape):
    """Strides of a no-copy reshape, or None when the view would need a copy.  Runs of old and
    new axes whose extents multiply to the same number pair up (NumPy's rule); each old run
    must be nested contiguously, and its new axes take strides from its innermost one."""
    if 0 in shape or 0 in new_shape:  # nothing to address: any strides do
        return contiguous_strides(new_shape)
    old = [(n, s) for n, s in zip(shape, strides) if n != 1]
    new = [j for j, n in enumerate(new_shape) if n != 1]
    out = [0] * len(new_shape)  # axes of extent 1: their strides never matter
    i = j = 0
    while i < len(old) and j < len(new):
        run_old, run_new = [i], [j]
        p_old, p_new = old[i][0], new_shape[new[j]]
        i, j = i + 1, j + 1
        while p_old != p_new:
            if p_old < p_new and i < len(old):
                p_old *= old[i][0]
                run_old.append(i)
                i += 1
            elif p_new < p_old and j < len(new):
                p_new *= new_shape[new[j]]
                run_new.append(j)
                j += 1
            else:
                return None
        if any(old[a][1] != old[b][0] * old[b][1] for a, b in zip(run_old, run_old[1:])):
            return None
        stride = old[run_old[-1]][1]
        for k in reversed(run_new):
            out[new[k]] = stride
            stride *= new_shape[new[k]]
    return tuple(out) if (i, j) == (len(old), len(new)) else None


def ordered_strides(shape, order=None):
    """Strides of a dense buffer of `shape` stored with its axes in `order`, outermost first
    (C order when None; e.g. (1, 0, 2) keeps axis 1 outermost: a rank-major gather buffer)."""
    order = order or tuple(range(len(shape)))
    phys = contiguous_strides(tuple(shape[o] for o in order))
    out = [0] * len(shape)
    for j, o in enumerate(order):
        out[o] = phys[j]
    return tuple(out)


def is_contiguous(shape, strides) -> bool:
    """C-contiguous, ignoring axes of extent 1 (their strides never matter)."""
    expect = 1
    for n, s in reversed(list(zip(shape, strides))):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def rank_major(shape, strides, axis: int, d: int):
    """(shape, strides) of the view [D, ...] of a buffer whose `axis` holds d blocks, block r
    first: how a collective reads or writes a gathered or to-be-scattered axis, rank by rank."""
    n, s = shape[axis], strides[axis]
    lk = n // d
    return (d,) + shape[:axis] + (lk,) + shape[axis + 1:], (lk * s,) + strides[:axis] + (s,) + strides[axis + 1:]
