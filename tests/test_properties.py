"""Property-based: random shapes, meshes and annotations, always the NumPy result."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfuse as sf
from cases import assert_close

EPILOGUES = {
    "mul_self": (lambda c: c * c, lambda c: c * c),
    "add_t": (lambda c: c + c.T.T, lambda c: 2 * c),
    "none": (lambda c: c, lambda c: c),
    "relu": (sf.relu, lambda c: np.maximum(c, 0)),
    "scale": (lambda c: c * 0.5, lambda c: 0.5 * c),
    "gelu": (sf.gelu, lambda c: 0.5 * c * (1 + np.tanh(np.sqrt(2 / np.pi) * (c + 0.044715 * c ** 3)))),
}


def annotate(v, how):
    kind, arg = how
    if kind == "shard":
        return sf.shard(v, axis=arg)
    if kind == "replicate":
        return sf.replicate(v)
    if kind == "stream":
        return sf.stream(v, axis=0, chunks=arg)
    return v


@settings(max_examples=150, deadline=None)
@given(d=st.integers(1, 4), mult=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)),
       x_how=st.sampled_from([("none", None), ("shard", 0), ("shard", 1)]),
       w_how=st.sampled_from([("none", None), ("shard", 0), ("shard", 1)]),
       out_how=st.sampled_from([("none", None), ("replicate", None), ("shard", 0), ("shard", 1), ("stream", 1),
                                ("stream", 2)]),
       epilogue=st.sampled_from(sorted(EPILOGUES)), streams=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_random_linear_layers(d, mult, x_how, w_how, out_how, epilogue, streams, seed):
    mesh = sf.DeviceMesh(d, backend="numpy")
    m, k, n = (2 * d * a for a in mult)  # every extent divides over d devices and 2 chunks
    fn, ref = EPILOGUES[epilogue]

    @sf.jit(mesh=mesh, streams=streams)
    def layer(x, w):
        return annotate(fn(annotate(x, x_how) @ annotate(w, w_how)), out_how)

    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    out = layer(x, w)
    assert_close(out.gather(), ref(x @ w), "float64")
    if out_how[0] == "replicate":
        assert out.placements == (sf.Replicate(),)
    if out_how[0] == "shard":
        assert out.placements == (sf.Shard(out_how[1]),)
