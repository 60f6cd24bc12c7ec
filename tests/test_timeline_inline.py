"""Timeline.plot's Figure shows inline in Jupyter as a cell's last value, exactly once, with or
without `%matplotlib inline` (it used to show as `<Figure size ...>` text without the magic)."""
from __future__ import annotations

import base64

import numpy as np
import pytest

import shardfuse as sf

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def figure():
    pytest.importorskip("matplotlib", reason="matplotlib is the optional [plot] extra")
    mesh = sf.DeviceMesh(2, backend="numpy")
    f = sf.jit(lambda a, b: sf.stream(sf.shard(a, axis=1) @ b, axis=0), mesh=mesh)
    a, b = np.ones((2, 2, 4, 8)), np.ones((8, 3))
    return f.lower(a, b).profile(a, b).plot()


def test_the_figure_has_a_png_repr(figure):
    png = figure._repr_png_()
    assert png[:8] == PNG and len(png) > 1000


def test_ipython_shows_it_once_without_the_magic(figure):
    formatters = pytest.importorskip("IPython.core.formatters")
    data, _ = formatters.DisplayFormatter().format(figure)  # a fresh formatter: no %matplotlib inline
    assert data["image/png"][:8] == PNG
    images = [k for k in data if k.startswith("image/")]
    assert images == ["image/png"], images  # one picture (beside the text/plain fallback)


def test_ipython_shows_it_once_with_the_magic(figure):
    formatters = pytest.importorskip("IPython.core.formatters")
    pt = pytest.importorskip("IPython.core.pylabtools")
    from matplotlib.figure import Figure

    shell = type("Shell", (), {"display_formatter": formatters.DisplayFormatter()})()
    pt.select_figure_formats(shell, {"png"})  # what %matplotlib inline registers for every Figure
    assert shell.display_formatter.formatters["image/png"].lookup_by_type(Figure)
    data, _ = shell.display_formatter.format(figure)
    assert [k for k in data if k.startswith("image/")] == ["image/png"]
    png = data["image/png"]
    assert (base64.b64decode(png) if isinstance(png, str) else png)[:8] == PNG  # (IPython's printer gives base64)
    # and the inline backend, which shows pyplot's open figures at a cell's end, never saw it
    import matplotlib.pyplot as plt

    assert all(plt.figure(n) is not figure for n in plt.get_fignums())
