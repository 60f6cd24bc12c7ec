"""Differential property test ("the net", issue 12 item 1).

Hypothesis writes small random programs -- input layouts x annotations x chunks x streams x
1-D and 2-D meshes x ops -- and each is run two ways: compiled by `sf.jit` on NumPy virtual
devices, and as plain float64 NumPy (the same source, with the annotations as identities).
The contract checked, per program:

  EITHER  lowering or the call raises a clear, deliberate error (ValueError, TypeError,
          NotImplementedError or PlanError, with a message, raised by a `raise` statement in
          shardfuse's own code -- not an IndexError or a broadcast error from inside NumPy),
  OR      every output, gathered whole, equals NumPy's (float64: rtol 1e-9, atol 1e-9 x the
          reference's scale), with no unwritten (poisoned NaN) element, in the layout the
          program's final annotation states, on two calls with fresh inputs (the first
          result still valid after the second call), the caller's inputs left untouched.

A program NumPy itself rejects must be refused.  How many programs ran and how many were
refused is counted per test (`hypothesis.event`, shown with --hypothesis-show-statistics) and
the test fails if too few ran, so that it cannot pass vacuously.

Profiles (registered in conftest.py): "ci", the default here (derandomized), and "long":
    .venv/bin/python -m pytest tests/test_differential.py --hypothesis-profile=long
On a failure the note printed above the error is a standalone repro script.
"""
from __future__ import annotations

import builtins
import linecache
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from itertools import permutations

import numpy as np
from hypothesis import HealthCheck, assume, event, given, note, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument, UnsatisfiedAssumption

import shardfuse as sf
import shardfuse.backends
from shardfuse.placements import placements_of
from shardfuse.sharding import Sharding
from cases import check_lives_apart

try:
    from shardfuse.passes.verify import PlanError
except ImportError:  # pragma: no cover - wherever it ends up, the public name
    PlanError = getattr(sf, "PlanError", AssertionError)

os.environ.setdefault("SHARDFUSE_POISON", "1")  # conftest sets it too: unwritten elements are NaN

# A refusal is one of these, raised by shardfuse, with a message, while compiling (`lower`): an
# error at call time may come after communication has started, which the contract forbids.
REFUSALS = (ValueError, TypeError, NotImplementedError)
LIB_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (sf, shardfuse.backends))
TOL = {"float64": 1e-9, "float32": 1e-4}
# PlanError is never a refusal: it is the verifier catching a plan the compiler got wrong.
MIN_RAN = 0.70  # at least this fraction of the generated programs must run (not be refused)


# ---- profiles ------------------------------------------------------------------------------

def _profile() -> settings:
    """The loaded Hypothesis profile; the plain default means "ci" (conftest registers both)."""
    get = getattr(settings, "get_current_profile_name", None)
    name = get() if get else getattr(settings, "_current_profile", "default")
    if name == "default":
        try:
            return settings.get_profile("ci")
        except InvalidArgument:  # conftest not loaded: the same values as its "ci" profile
            return settings(max_examples=300, deadline=None, derandomize=True, database=None)
    return settings()


PROFILE = settings(_profile(), suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                      HealthCheck.filter_too_much])

# ---- meshes and the `over` choices ---------------------------------------------------------

MESHES = {
    "1": (sf.DeviceMesh(1, backend="numpy"), "sf.DeviceMesh(1, backend='numpy')"),
    "2": (sf.DeviceMesh(2, backend="numpy"), "sf.DeviceMesh(2, backend='numpy')"),
    "4": (sf.DeviceMesh(4, backend="numpy"), "sf.DeviceMesh(4, backend='numpy')"),
    "2x2": (sf.DeviceMesh((2, 2), backend="numpy"), "sf.DeviceMesh((2, 2), backend='numpy')"),
    "2x4": (sf.DeviceMesh((2, 4), backend="numpy"), "sf.DeviceMesh((2, 4), backend='numpy')"),
}
MESHES_1D = ["4", "2", "1"]
MESHES_2D = ["2x2", "2x4"]
ALL_MESHES = ["4", "2x2", "2", "2x4", "1"]

# >>> HOOK (issue 12): a dim sharded over a tuple of mesh axes, `over=("DIDy", "DIDx")`.
# Every strategy below draws `over` from over_choices() and sizes it with over_size(), and the
# chain bookkeeping moves each member of a tuple off the other axes, so widening the choices
# here (e.g. to three-axis tuples on a 3-D mesh) is all a new form of `over` needs.  The library takes
# tuples now (README), so they are on by default; SHARDFUSE_TEST_MULTI_OVER=0 leaves them out.
MULTI_AXIS_OVER = os.environ.get("SHARDFUSE_TEST_MULTI_OVER", "1") == "1"


def over_choices(mesh) -> list:
    """Every value `over=` may take on this mesh (one mesh axis name, or a tuple of them)."""
    names = list(mesh.axis_names)
    if MULTI_AXIS_OVER and len(names) > 1:
        names += [tuple(p) for p in permutations(mesh.axis_names, 2)]
    return names


def over_axes(over) -> tuple:
    return tuple(over) if isinstance(over, tuple) else (over,)


def over_size(mesh, over) -> int:
    return math.prod(mesh.axis_size(a) for a in over_axes(over))
# <<< HOOK

# Sub-meshes of each mesh (devices, axis names or None for the parent's last): pipeline stages in
# device order and out of it, of one device, of every device, and with an axis name the parent
# lacks.  A program names them S0, S1, ... (`sf.shard(v, 0, mesh=S1)`) and moves values between
# them and the whole mesh (issue 30: the moves, reshapes and streams there were wrong).
SUBMESHES = {
    "1": [],
    "2": [((1,), None), ((1, 0), None)],
    "4": [((0, 1), None), ((2, 3), None), ((3, 1, 2, 0), None), ((1,), None), ((0, 1), ("pp",))],
    "2x2": [((0, 1), None), ((2, 0, 3, 1), None), ((3,), None), ((1, 3), ("pp",))],
    "2x4": [((0, 1, 2, 3), None), ((7, 5, 3, 1), None), ((4, 5), None), (tuple(range(8)), ("pp",)), ((6,), None)],
}
SUBS = {k: [MESHES[k][0].submesh(d, n) for d, n in v] for k, v in SUBMESHES.items()}


EXTENTS = (4, 8, 2, 16, 12, 6, 3)  # shrinks towards 4; 2, 6 and 3 do not divide every mesh axis
BATCH = (2, 4, 3)
SCALARS = ("0.5", "2.0", "3", "-1.5")


# ---- the NumPy reference: the same source with the annotations as identities --------------

def _gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


class NumpySF:
    """`sf` as the reference sees it: float64 NumPy, annotations do nothing."""

    shard = staticmethod(lambda x, axis, over="DIDx", mesh=None: x)
    replicate = staticmethod(lambda x, mesh=None: x)
    to_mesh = staticmethod(lambda x, mesh, axis=None, over=None: x)
    stream = staticmethod(lambda x, axis, chunks=None, algorithm="collective": x)
    gelu = staticmethod(_gelu)
    relu = staticmethod(lambda x: np.maximum(x, 0.0))
    exp = staticmethod(np.exp)
    tanh = staticmethod(np.tanh)
    linear = staticmethod(lambda x, w, b=None: x @ w if b is None else x @ w + b)


NUMPY_SF_SRC = '''class npsf:  # the NumPy reference: the same function, annotations as identities
    shard = staticmethod(lambda x, axis, over="DIDx", mesh=None: x)
    replicate = staticmethod(lambda x, mesh=None: x)
    to_mesh = staticmethod(lambda x, mesh, axis=None, over=None: x)
    stream = staticmethod(lambda x, axis, chunks=None, algorithm="collective": x)
    gelu = staticmethod(lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))))
    relu = staticmethod(lambda x: np.maximum(x, 0.0))
    exp, tanh = staticmethod(np.exp), staticmethod(np.tanh)
    linear = staticmethod(lambda x, w, b=None: x @ w if b is None else x @ w + b)
'''


# ---- programs ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Chain:
    """The layout a run of annotations on one value states: what sf.shard/sf.stream check."""

    sharded: tuple = ()  # ((tensor axis, over), ...)
    stream: tuple | None = None  # (tensor axis, chunks, ring)

    def over_of(self, axis):
        return next((o for a, o in self.sharded if a == axis), None)

    def with_shard(self, axis, over) -> "Chain":
        """The annotation rule (README): `axis` sharded over `over`, whose mesh axes leave every
        other tensor axis; the other axes keep the rest of their sharding."""
        taken = set(over_axes(over))
        rest = [(a, tuple(m for m in over_axes(o) if m not in taken)) for a, o in self.sharded if a != axis]
        return Chain(tuple((a, m if len(m) > 1 else m[0]) for a, m in rest if m) + ((axis, over),), self.stream)


@dataclass
class Val:
    name: str
    shape: tuple
    chain: Chain | None = None  # set when this value is the output of an annotation
    pos: bool = False  # known positive and away from 0 (a divisor)
    home: int | None = None  # the sub-mesh (SUBS[mesh][home]) it lives on; None: the whole mesh


@dataclass
class Inp:
    name: str
    shape: tuple
    pos: bool
    place: tuple = ()  # () plain NumPy; ("replicate",); ("shard", ((axis, over), ...))


@dataclass
class Prog:
    mesh_key: str
    streams: int
    dtype: str
    inputs: list = field(default_factory=list)
    lines: list = field(default_factory=list)
    outs: list = field(default_factory=list)
    wild: bool = False  # a draw meant to be refused was taken

    @property
    def mesh(self):
        return MESHES[self.mesh_key][0]

    def mesh_of(self, home):
        return self.mesh if home is None else SUBS[self.mesh_key][home]

    def subs_src(self) -> str:
        return "".join(f"S{k} = mesh.submesh({d}{'' if n is None else f', {n!r}'})\n"
                       for k, (d, n) in enumerate(SUBMESHES[self.mesh_key]))

    def source(self) -> str:
        body = "".join(f"    {line}\n" for line in self.lines)
        ret = ", ".join(o.name for o in self.outs)
        return f"def f({', '.join(i.name for i in self.inputs)}):\n{body}    return {ret}\n"

    def make_inputs(self, seed: int) -> list:
        """Fresh global inputs: normal (never zeros), divisors uniform in [0.5, 2]."""
        rng = np.random.default_rng(seed)
        out = []
        for i in self.inputs:
            x = rng.uniform(0.5, 2.0, i.shape) if i.pos else rng.standard_normal(i.shape)
            out.append(x.astype(self.dtype))
        return out

    def place(self, globals_: list) -> list:
        mesh = self.mesh
        args = []
        for i, g in zip(self.inputs, globals_):
            if not i.place:
                args.append(g)
            elif i.place[0] == "replicate":
                args.append(sf.replicate(g, mesh=mesh))
            elif len(i.place[1]) == 1:
                (axis, over), = i.place[1]
                args.append(sf.shard(g, axis=axis, over=over, mesh=mesh))
            else:  # sharded on two dims: placed by a jitted identity (R -> S is a local slice)
                args.append(sf.jit(_placer(i.place[1]), mesh=mesh)(g))
                placed = args[-1].gather()
                assert placed.shape == g.shape and np.array_equal(placed, g), \
                    f"placing {i.name} as {i.place[1]} changed it: max error {np.abs(placed - g).max():.3e}"
        return args

    def input_src(self, seed: int) -> str:
        lines = [f"rng = np.random.default_rng({seed})"]
        for i in self.inputs:
            gen = f"rng.uniform(0.5, 2.0, {i.shape})" if i.pos else f"rng.standard_normal({i.shape})"
            lines.append(f"{i.name} = {gen}.astype({self.dtype!r})")
        return "\n".join(lines)

    def args_src(self) -> tuple:
        lines, names = [], []
        for i in self.inputs:
            if not i.place:
                names.append(i.name)
                continue
            a = "a" + i.name[1:]
            if i.place[0] == "replicate":
                lines.append(f"{a} = sf.replicate({i.name}, mesh=mesh)")
            elif len(i.place[1]) == 1:
                (axis, over), = i.place[1]
                lines.append(f"{a} = sf.shard({i.name}, axis={axis}, over={over!r}, mesh=mesh)")
            else:
                inner = "x"
                for axis, over in i.place[1]:
                    inner = f"sf.shard({inner}, {axis}, over={over!r})"
                lines.append(f"{a} = sf.jit(lambda x: {inner}, mesh=mesh)({i.name})  # placed on two dims")
            names.append(a)
        return lines, names

    def repro(self, seed: int) -> str:
        lines, names = self.args_src()
        outs = ", ".join(f"o{k}" for k in range(len(self.outs))) + ("," if len(self.outs) == 1 else "")
        refs = ", ".join(f"r{k}" for k in range(len(self.outs))) + ("," if len(self.outs) == 1 else "")
        check = "\n".join(
            f"print('output {k}: max abs error', np.abs(np.asarray(o{k}.gather(), np.float64) - r{k}).max())"
            for k in range(len(self.outs)))
        ins64 = ", ".join(f"{i.name}.astype(np.float64)" for i in self.inputs)
        return (f"# ---- repro (standalone) ----\nimport os; os.environ['SHARDFUSE_POISON'] = '1'\n"
                f"import types, numpy as np, shardfuse as sf\nmesh = {MESHES[self.mesh_key][1]}\n"
                f"{self.subs_src()}{self.input_src(seed)}\n{self.source()}"
                + "\n".join(lines + [f"{outs} = sf.jit(f, mesh=mesh, streams={self.streams})({', '.join(names)})"])
                + f"\n{NUMPY_SF_SRC}ref_f = types.FunctionType(f.__code__, {{**globals(), 'sf': npsf}})  # f, sf -> npsf\n"
                + f"{refs} = (lambda out: out if isinstance(out, tuple) else (out,))(ref_f({ins64}))\n"
                + check + "\n# ----")


def _placer(dims):
    def place(x):
        for axis, over in dims:
            x = sf.shard(x, axis, over=over)
        return x
    return place


# ---- the generator ---------------------------------------------------------------------------

class Gen:
    """Draws one program, keeping track of shapes and annotation chains so that most of what
    it writes is valid; `wild` draws (rare) deliberately write what should be refused."""

    def __init__(self, data, mesh_key, dtype, streams, wild=3):
        self.draw = data.draw
        self.prog = Prog(mesh_key, streams, dtype)
        self.mesh = self.prog.mesh
        self.overs = over_choices(self.mesh)
        self.pool: list = []
        self.count = 0
        self.wild_pct = wild

    # -- draws: index 0 / False is the plain choice, so shrinking simplifies
    def chance(self, pct) -> bool:
        return pct > 0 and self.draw(st.integers(0, 99)) >= 100 - pct

    def pick(self, seq):
        return self.draw(st.sampled_from(list(seq)))

    def wild(self) -> bool:
        w = self.chance(self.wild_pct)
        self.prog.wild |= w
        return w

    def emit(self, expr, shape, chain=None, pos=False, home=None) -> Val:
        self.count += 1
        v = Val(f"v{self.count}", tuple(shape), chain, pos, home)
        self.prog.lines.append(f"{v.name} = {expr}")
        self.pool.append(v)
        return v

    # -- inputs
    def new_input(self, shape, pos=False, placed=None) -> Val:
        """placed: None (draw plain or placed), True (always placed), False (plain)."""
        shape = tuple(shape)
        place = ()
        if placed is not False:
            kinds = ["shard", "shard2", "shard", "replicate"] if placed else ["plain", "shard", "shard", "shard2",
                                                                               "replicate"]
            kind = self.pick(kinds)
            singles = [((a, o),) for a in range(len(shape)) for o in self.overs
                       if shape[a] % over_size(self.mesh, o) == 0]
            pairs = [((a1, o1), (a2, o2)) for (a1, o1), in singles for (a2, o2), in singles
                     if a1 != a2 and not set(over_axes(o1)) & set(over_axes(o2))]
            if kind == "shard2" and pairs:
                place = ("shard", self.pick(pairs))
            elif kind in ("shard", "shard2") and singles:
                place = ("shard", self.pick(singles))
            elif kind == "replicate" or (placed and not singles):
                place = ("replicate",)
        inp = Inp(f"x{len(self.prog.inputs)}", shape, pos, place)
        self.prog.inputs.append(inp)
        v = Val(inp.name, shape, None, pos)
        self.pool.append(v)
        return v

    def extent(self):
        return self.pick(EXTENTS)

    def shape(self, ndim):
        return tuple(self.extent() if j >= ndim - 2 else self.pick(BATCH) for j in range(ndim))

    # -- annotations
    def where(self, home) -> str:
        """The mesh= argument that keeps (or puts) a value on `home`."""
        return "" if home is None else f", mesh=S{home}"

    def annotate(self, v: Val, what=None) -> Val:
        if not v.shape:
            return v
        home = v.home
        mesh, at = self.prog.mesh_of(home), self.where(home)
        what = what or self.pick(["shard", "stream", "shard", "replicate"])
        if what == "replicate":
            return self.emit(f"sf.replicate({v.name}{at})", v.shape, Chain(), v.pos, home)
        chain = v.chain or Chain()
        nd = len(v.shape)
        ring = what == "stream" and self.chance(5)
        overs = over_choices(mesh)
        shards = [(a, o) for a in range(nd) for o in overs if self._can_shard(v, chain, a, o, mesh)]
        streams = [(a, c) for a in range(nd) for c in (None, 1, 2, 4) if self._can_stream(v, chain, a, c, ring, mesh)]
        if not (shards if what == "shard" else streams):  # nothing valid of that kind: the other one
            what = "stream" if what == "shard" and streams else "shard" if shards else what
        wild = self.wild()
        if not wild and not (shards if what == "shard" else streams):  # nothing valid at all
            return self.emit(f"sf.replicate({v.name}{at})", v.shape, Chain(), v.pos, home)
        if what == "shard":
            if not wild:
                a, o = self.pick(shards)
            else:
                dup = [(mesh.axis_names[-1],) * 2] if MULTI_AXIS_OVER else []  # a mesh axis twice
                a, o = self.pick(range(-nd, nd + 1)), self.pick(overs + ["DIDz"] + dup)
            kw = "" if o == "DIDx" and mesh.axis_names == ("DIDx",) and self.chance(50) else f", over={o!r}"
            new = chain.with_shard(a % nd if -nd <= a < nd else a, o)
            return self.emit(f"sf.shard({v.name}, {a}{kw}{at})", v.shape, new, v.pos, home)
        if not wild:
            a, c = self.pick(streams)
        else:
            a, c = self.pick(range(-nd, nd + 1)), self.pick([None, 3, 0, 2, 8])
        args = (f", chunks={c}" if c is not None else "") + (", algorithm='ring'" if ring else "")
        new = Chain(chain.sharded, (a % nd if -nd <= a < nd else a, c, ring))
        return self.emit(f"sf.stream({v.name}, {a}{args})", v.shape, new, v.pos, home)

    def move(self, v: Val, to="any") -> Val:
        """v moved to another mesh (to: a sub-mesh index, None for the whole mesh, "any" to draw
        one): sharded there on one axis, replicated there, or by sf.to_mesh (no annotation)."""
        subs = SUBS[self.prog.mesh_key]
        if not v.shape or (to == "any" and not subs):
            return self.annotate(v)
        if to == "any":
            to = self.pick([k for k in range(len(subs)) if k != v.home] + ([None] if v.home is not None else []))
        if to == v.home:
            return v
        mesh, at = self.prog.mesh_of(to), self.where(to)
        # an annotation that moves a value starts replicated there, keeping its stream (trace._placed)
        chain = Chain((), v.chain.stream if v.chain else None)
        shards = [(a, o) for a in range(len(v.shape)) for o in over_choices(mesh)
                  if self._can_shard(v, chain, a, o, mesh)]
        how = self.pick(["shard", "replicate", "shard", "to_mesh"])
        if how == "to_mesh" and to is not None and chain.stream is None:
            axes = [a for a in range(len(v.shape)) if v.shape[a] % mesh.size == 0]
            if axes and self.chance(70):
                return self.emit(f"sf.to_mesh({v.name}, S{to}, axis={self.pick(axes)})", v.shape, None, v.pos, to)
            return self.emit(f"sf.to_mesh({v.name}, S{to})", v.shape, None, v.pos, to)
        if how != "replicate" and shards:
            a, o = self.pick(shards)
            return self.emit(f"sf.shard({v.name}, {a}, over={o!r}{at})", v.shape, chain.with_shard(a, o), v.pos, to)
        return self.emit(f"sf.replicate({v.name}{at})", v.shape, Chain(), v.pos, to)

    def _size(self, o, mesh):
        """over_size, or None for a name this mesh lacks (a wild draw's, refused already)."""
        return over_size(mesh, o) if set(over_axes(o)) <= set(mesh.axis_names) else None

    def _can_shard(self, v, chain, a, o, mesh) -> bool:
        n = self._size(o, mesh)
        if n is None or v.shape[a] % n:  # (re-sharding an axis, or moving a mesh axis, is one annotation too)
            return False
        if chain.stream and chain.stream[0] == a:
            c = chain.stream[1]
            return bool(c) and c > 0 and not chain.stream[2] and v.shape[a] % (n * c) == 0
        return True

    def _can_stream(self, v, chain, a, c, ring, mesh) -> bool:
        if chain.stream is not None or (ring and c is not None):
            return False
        if c is not None and v.shape[a] % c:
            return False
        o = chain.over_of(a)
        if o is not None:
            n = self._size(o, mesh)
            return c is not None and n is not None and v.shape[a] % (n * c) == 0
        return True

    def maybe_annotate(self, v, pct) -> Val:
        return self.annotate(v) if self.chance(pct) else v

    # -- ops
    def to_home(self, p: Val, home) -> Val:
        """p on the mesh `home` (an operand beside a value there): moved if it lives elsewhere."""
        return p if p.home == home else self.move(p, home)

    def unary(self, v: Val) -> Val:
        op = self.pick(["gelu", "relu", "tanh", "exp", "neg", "scale", "rscale", "div_scalar", "add_scalar"])
        if op == "add_scalar" and not self.wild():  # (a wild draw: scalar + is not in the README)
            op = "scale"
        if op in ("gelu", "relu", "tanh", "exp"):
            return self.emit(f"sf.{op}({v.name})", v.shape, pos=op == "exp", home=v.home)
        if op == "neg":
            return self.emit(f"-{v.name}", v.shape, home=v.home)
        c = self.pick(SCALARS)
        if op == "scale":
            return self.emit(f"{v.name} * {c}", v.shape, home=v.home)
        if op == "rscale":
            return self.emit(f"{c} * {v.name}", v.shape, home=v.home)
        if op == "div_scalar":
            return self.emit(f"{v.name} / {c}", v.shape, home=v.home)
        return self.emit(f"{v.name} + {c}", v.shape, home=v.home)  # a scalar add: supported or refused

    def partner_shape(self, shape):
        """A shape that broadcasts with `shape`: the same, a suffix, unit dims, a new lead dim."""
        form = self.pick(["same", "suffix", "ones", "lead"])
        if form == "suffix" and len(shape) > 1:
            return shape[self.pick(range(1, len(shape))):]
        if form == "ones" and shape:
            return tuple(1 if self.chance(40) else s for s in shape)
        if form == "lead" and len(shape) < 3:
            return (self.pick(BATCH),) + tuple(shape)
        return tuple(shape)

    def binary(self, v: Val) -> Val:
        op = self.pick(["+", "*", "-", "/"])
        others = [p for p in self.pool if p is not v and _broadcasts(p.shape, v.shape) and p.shape and p.home == v.home]
        if others and self.chance(30):
            p = self.pick(others)
        else:
            p = self.new_input(self.partner_shape(v.shape), pos=(op == "/"))
            p = self.to_home(self.maybe_annotate(p, 30), v.home)
        if op == "/" and not p.pos:
            p = self.emit(f"sf.exp({p.name})", p.shape, pos=True, home=p.home)
        shape = np.broadcast_shapes(v.shape, p.shape)
        if op != "/" and self.chance(40):
            return self.emit(f"{p.name} {op} {v.name}", shape, home=v.home)
        return self.emit(f"{v.name} {op} {p.name}", shape, home=v.home)

    def reduce(self, v: Val) -> Val:
        if len(v.shape) < 2 and not self.chance(5):  # rarely: a 1-D value reduced to 0-d
            return self.unary(v)
        if not v.shape:
            return v
        nd = len(v.shape)
        a = self.pick(list(range(nd)) + [-1])
        how = self.pick(["sum", "mean"])
        keep = a % nd
        return self.emit(f"{v.name}.{how}({a})", v.shape[:keep] + v.shape[keep + 1:], home=v.home)

    def transpose(self, v: Val) -> Val:
        nd = len(v.shape)
        if nd < 2:
            return self.unary(v)
        if nd == 2 or self.chance(40):
            return self.emit(f"{v.name}.T", v.shape[::-1], home=v.home)
        perm = tuple(self.draw(st.permutations(range(nd))))
        return self.emit(f"{v.name}.transpose({', '.join(map(str, perm))})", tuple(v.shape[p] for p in perm), home=v.home)

    def reshape(self, v: Val) -> Val:
        shape = list(v.shape)
        nd = len(shape)
        splits = [(j, f) for j, s in enumerate(shape) for f in (2, 3, 4) if s % f == 0 and s > f]
        merge = nd >= 2 and (nd >= 4 or not splits or self.chance(50))
        if merge:
            j = self.pick(range(nd - 1))
            new = shape[:j] + [shape[j] * shape[j + 1]] + shape[j + 2:]
        elif splits:
            j, f = self.pick(splits)
            new = shape[:j] + [f, shape[j] // f] + shape[j + 1:]
        else:
            return self.unary(v)
        text = list(map(str, new))
        if self.chance(30):
            text[self.pick(range(len(new)))] = "-1"
        return self.emit(f"{v.name}.reshape({', '.join(text)})", new, home=v.home)

    def matmul(self, v: Val) -> Val:
        nd = len(v.shape)
        if nd < 2:
            return self.unary(v)
        form = self.pick(["right", "left", "batched", "linear", "self", "right"])
        K, N = v.shape[-1], self.extent()
        if form == "batched" and nd >= 3:
            w = self.to_home(self.maybe_annotate(self.new_input(v.shape[:-2] + (K, N)), 40), v.home)
            return self.emit(f"{v.name} @ {w.name}", v.shape[:-1] + (N,), home=v.home)
        if form == "left":
            M = self.extent()
            lead = v.shape[:-2] if nd >= 3 else ((self.pick(BATCH),) if self.chance(30) else ())
            a = self.to_home(self.maybe_annotate(self.new_input(lead + (M, v.shape[-2])), 40), v.home)
            return self.emit(f"{a.name} @ {v.name}", lead + (M, K), home=v.home)
        if form == "linear":
            w = self.to_home(self.maybe_annotate(self.new_input((K, N)), 40), v.home)
            if self.chance(70):
                b = self.to_home(self.maybe_annotate(self.new_input((N,)), 30), v.home)
                return self.emit(f"sf.linear({v.name}, {w.name}, {b.name})", v.shape[:-1] + (N,), home=v.home)
            return self.emit(f"sf.linear({v.name}, {w.name})", v.shape[:-1] + (N,), home=v.home)
        if form == "self" and nd == 2:
            if self.chance(50):
                return self.emit(f"{v.name} @ {v.name}.T", (v.shape[0], v.shape[0]), home=v.home)
            return self.emit(f"{v.name}.T @ {v.name}", (K, K), home=v.home)
        w = self.to_home(self.maybe_annotate(self.new_input((K, N)), 40), v.home)
        return self.emit(f"{v.name} @ {w.name}", v.shape[:-1] + (N,), home=v.home)

    def index(self, v: Val) -> Val:
        """Issue 31 item 3: basic indexing (ints, slices, steps, '...', None), or np.concatenate /
        np.split along a random axis."""
        nd = len(v.shape)
        if not nd:
            return v
        if self.chance(30):
            a = self.pick(range(nd))
            if v.shape[a] < 2 or self.chance(50):  # (a split of an axis of extent 1 would leave an empty piece)
                p = self.new_input(v.shape[:a] + (self.extent(),) + v.shape[a + 1:], pos=v.pos)
                p = self.to_home(self.maybe_annotate(p, 40), v.home)
                shape = v.shape[:a] + (v.shape[a] + p.shape[a],) + v.shape[a + 1:]
                return self.emit(f"np.concatenate([{v.name}, {p.name}], axis={a - nd if self.chance(30) else a})",
                                 shape, pos=v.pos, home=v.home)
            cut = self.pick(range(1, v.shape[a]))
            part = self.pick([0, 1])
            return self.emit(f"np.split({v.name}, [{cut}], axis={a})[{part}]",
                             v.shape[:a] + ((cut, v.shape[a] - cut)[part],) + v.shape[a + 1:], pos=v.pos, home=v.home)
        parts, shape = [], []
        for n in v.shape:
            form = self.pick(["all", "all", "int", "range", "step"])
            if form == "int" and len(parts) < nd - 1:
                parts.append(str(self.pick(range(-n, n))))
            elif form in ("range", "step") and n > 1:
                lo = self.pick(range(n - 1))
                hi, step = self.pick(range(lo + 1, n + 1)), 2 if form == "step" else 1
                parts.append(f"{lo}:{hi}" + (":2" if step == 2 else "") if self.chance(70) else f"{lo - n}:{hi}")
                shape.append(len(range(lo, hi, step)))
            else:
                parts.append(":")
                shape.append(n)
        if self.chance(25):
            at = self.pick(range(len(parts) + 1))
            parts.insert(at, "None")
            shape.insert(sum(p != "None" and not p.lstrip("-").isdigit() for p in parts[:at]), 1)
        return self.emit(f"{v.name}[{', '.join(parts)}]", shape, pos=v.pos, home=v.home)

    STEPS = ("annotate", "unary", "binary", "reduce", "transpose", "reshape", "matmul", "move", "index")

    def step(self, kind, v):
        return getattr(self, kind)(v)

    def body(self, first: Val, kinds, n_steps, branch=15, two_outputs=0):
        cur = first
        for _ in range(n_steps):
            if len(self.pool) > 1 and self.chance(branch):
                cur = self.pick([p for p in self.pool if p.shape])
            cur = self.step(self.pick(kinds), cur)
            if not cur.shape:
                break  # a 0-d value: nothing more to do with it
        self.prog.outs = [cur]
        others = [p for p in self.pool if p is not cur and p.name.startswith("v")]
        if others and self.chance(two_outputs):
            self.prog.outs.append(self.pick(others))
        return self.prog


def _broadcasts(a, b) -> bool:
    try:
        np.broadcast_shapes(a, b)
        return True
    except ValueError:
        return False


# ---- running one program ---------------------------------------------------------------------

STATS: dict = {}


def deliberate(e: BaseException) -> bool:
    """A clear error of shardfuse's own: a refusal type, a message, raised by a `raise`
    statement in shardfuse's code (a NumPy error surfacing from a backend is not one)."""
    if not isinstance(e, REFUSALS) or not str(e).strip():
        return False
    tb, last = e.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    if last is None:
        return False
    fname = os.path.abspath(last.tb_frame.f_code.co_filename)
    line = linecache.getline(fname, last.tb_lineno).strip()
    if not (fname.startswith(LIB_DIRS) and line.startswith("raise")):
        return False
    # the error the statement meant to raise, not one raised while building its message
    m = re.match(r"raise\s+([A-Za-z_]\w*)\s*\(", line)
    if m:
        cls = last.tb_frame.f_globals.get(m.group(1), getattr(builtins, m.group(1), None))
        if isinstance(cls, type) and not isinstance(e, cls):
            return False
    return not isinstance(e, PlanError)


def category(e) -> str:
    msg = re.sub(r"\b[vxa]\d+\w*", "<v>", str(e).splitlines()[0] if str(e) else "")
    return f"{type(e).__name__}: {re.sub(r'[0-9]+', 'N', msg)[:80]}"


def _check_output(got_arr, ref, val: Val, prog: Prog, what: str):
    assert isinstance(got_arr, sf.Array), f"{what}: expected an sf.Array, got {type(got_arr).__name__}"
    got = np.asarray(got_arr.gather())
    assert got.shape == ref.shape, f"{what}: shape {got.shape}, NumPy's {ref.shape}"
    assert got_arr.dtype_name == prog.dtype, f"{what}: dtype {got_arr.dtype_name}, expected {prog.dtype}"
    got = got.astype(np.float64)
    nonfinite = ~np.isfinite(got)
    if nonfinite.any():
        idx = tuple(int(i) for i in np.argwhere(nonfinite)[0])
        raise AssertionError(f"{what}: {int(nonfinite.sum())} of {got.size} elements unwritten (NaN poison) or "
                             f"non-finite, first at {idx}; layout {got_arr.sharding.placements(prog.mesh)}")
    tol = TOL[prog.dtype]
    scale = max(1.0, float(np.abs(ref).max()) if ref.size else 1.0)
    bad = ~(np.abs(got - ref) <= tol * scale + tol * np.abs(ref))
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {got.size} elements wrong, max abs error "
                             f"{np.abs(got - ref).max():.3e} (reference scale {scale:.3g}), first at {idx}: "
                             f"got {got[idx]!r}, NumPy {ref[idx]!r}; layout {got_arr.sharding.placements(prog.mesh)}")
    mesh = prog.mesh_of(val.home)
    if val.chain is not None or val.home is not None:  # a value the program put somewhere (an unannotated one
        lives = got_arr.sharding.home(prog.mesh)     # lives where its inputs do: a plain input where it is first annotated)
        assert lives.devices == mesh.devices, f"{what}: lives on devices {lives.devices}, the program put it on {mesh}"
    if val.chain is not None:  # the layout rule: an annotated value has exactly the stated layout
        # a tuple `over` shards the dim over each of its mesh axes, in its order (outermost first): placements
        # (S(0), S(0)) in the mesh's order, (_S(0, 2), S(0)) in the other (DTensor's _StridedShard)
        dims = [()] * got_arr.ndim
        for a, o in val.chain.sharded:
            dims[a] = over_axes(o)
        want = Sharding(mesh, tuple(dims))
        have = got_arr.sharding.sharding(mesh)
        assert have.dims == want.dims and placements_of(got_arr.sharding, mesh) == want.placements(), \
            f"{what}: placements {tuple(map(str, have.placements()))}, the annotations state " \
            f"{tuple(map(str, want.placements()))}"


def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def run_program(prog: Prog, seed: int, stats: Counter):
    src = prog.source()
    note(prog.repro(seed))
    subs = {f"S{k}": m for k, m in enumerate(SUBS[prog.mesh_key])}
    ns_sf, ns_np = {"sf": sf, "np": np, **subs}, {"sf": NumpySF, "np": np, **subs}
    exec(src, ns_sf)
    exec(src, ns_np)
    fn, ref_fn = ns_sf["f"], ns_np["f"]

    def reference(inputs):
        with np.errstate(all="ignore"):
            out = tuple(np.asarray(r, np.float64) for r in as_tuple(ref_fn(*(x.astype(np.float64) for x in inputs))))
            if prog.dtype != "float64":  # a value that overflows in the narrow type itself is no test
                narrow = as_tuple(ref_fn(*inputs))
                assume(all(np.all(np.isfinite(np.asarray(r, np.float64))) for r in narrow))
        return out

    inputs = prog.make_inputs(seed)
    try:
        ref = reference(inputs)
        ref_error = None
    except UnsatisfiedAssumption:  # the narrow type overflows in NumPy itself: no test (assume above)
        raise
    except Exception as e:  # NumPy rejects the program: shardfuse must refuse it too
        ref, ref_error = None, e
    if ref is not None:
        assume(all(np.all(np.isfinite(r)) and (not r.size or np.abs(r).max() < 1e100) for r in ref))

    jitted = sf.jit(fn, mesh=prog.mesh, streams=prog.streams)
    args = prog.place(inputs)
    specs = [a.spec if isinstance(a, sf.Array) else sf.TensorSpec(a.shape, prog.dtype) for a in args]

    def refused(e, phase):
        if phase != "lower":
            raise AssertionError(f"{phase} raised {type(e).__name__} after the plan compiled: errors must come "
                                 f"before any communication, from lower(): {e}") from e
        if not deliberate(e):
            raise AssertionError(f"{phase} raised {type(e).__name__} that is not a clear refusal "
                                 f"(not raised by shardfuse itself, or no message): {e}") from e
        kind = "invalid" if ref_error is not None else "wild" if prog.wild else "valid"
        stats["refused"] += 1
        stats[f"refused {kind} @{phase}: {category(e)}"] += 1
        event(f"refused ({kind}) at {phase}")
        event(f"refused: {category(e)}")

    try:
        plan = jitted.lower(*specs)
    except Exception as e:
        return refused(e, "lower")
    check_lives_apart(plan.program)  # no slab holds two values live at once (passes/reuse.py)
    try:
        out1 = as_tuple(jitted(*args))
    except Exception as e:
        return refused(e, "call")
    assert ref_error is None, f"NumPy rejects this program ({type(ref_error).__name__}: {ref_error}), " \
                              f"but shardfuse ran it"
    stats["ran"] += 1
    event("ran")
    assert len(out1) == len(ref), f"{len(out1)} outputs, NumPy's {len(ref)}"
    for k, (o, r, v) in enumerate(zip(out1, ref, prog.outs)):
        _check_output(o, r, v, prog, f"call 1, output {k}")
    for x, x0 in zip(inputs, prog.make_inputs(seed)):
        assert np.array_equal(x, x0), "the call wrote into the caller's input array"

    # a second call on fresh inputs: nothing stale from the first, and its results stay valid
    inputs2 = prog.make_inputs(seed + 1)
    ref2 = reference(inputs2)
    assume(all(np.all(np.isfinite(r)) and (not r.size or np.abs(r).max() < 1e100) for r in ref2))
    out2 = as_tuple(jitted(*prog.place(inputs2)))
    for k, (o, r, v) in enumerate(zip(out2, ref2, prog.outs)):
        _check_output(o, r, v, prog, f"call 2 (fresh inputs), output {k}")
    for k, (o, r, v) in enumerate(zip(out1, ref, prog.outs)):
        _check_output(o, r, v, prog, f"call 1's output {k} after call 2")


def common_draws(data, meshes, f32=0):
    mesh_key = data.draw(st.sampled_from(meshes), label="mesh")
    streams = data.draw(st.integers(1, 4), label="streams")
    dtype = "float32" if f32 and data.draw(st.integers(0, 99)) >= 100 - f32 else "float64"
    seed = data.draw(st.integers(0, 2**32 - 2), label="seed")
    return mesh_key, streams, dtype, seed


def _drive(prop, name):
    stats = STATS[name] = Counter()
    prop()
    total = stats["ran"] + stats["refused"]
    summary = "".join(f"\n  {v:5d}  {k}" for k, v in stats.most_common() if k.startswith("refused "))
    print(f"\n[{name}] {total} programs: {stats['ran']} ran, {stats['refused']} refused{summary}")
    assert total > 0, "no program got as far as shardfuse"
    assert stats["ran"] / total >= MIN_RAN, \
        f"only {stats['ran']} of {total} programs ran (the rest were refused): the net is too loose; {summary}"


# ---- the properties --------------------------------------------------------------------------

@PROFILE
@given(data=st.data())
def _elementwise_and_reductions(data):
    mesh_key, streams, dtype, seed = common_draws(data, ALL_MESHES, f32=10)
    g = Gen(data, mesh_key, dtype, streams)
    x = g.new_input(g.shape(g.pick([2, 1, 3])))
    kinds = ["annotate", "unary", "binary", "annotate", "reduce", "transpose", "reshape", "binary", "index"]
    prog = g.body(x, kinds, g.draw(st.integers(1, 6), label="steps"))
    run_program(prog, seed, STATS["elementwise"])


@PROFILE
@given(data=st.data())
def _matmul_chains(data):
    mesh_key, streams, dtype, seed = common_draws(data, ALL_MESHES, f32=10)
    g = Gen(data, mesh_key, dtype, streams)
    x = g.maybe_annotate(g.new_input(g.shape(g.pick([2, 3]))), 50)
    cur = g.matmul(x)
    kinds = ["annotate", "matmul", "annotate", "unary", "binary", "reduce", "transpose", "annotate", "index"]
    prog = g.body(cur, kinds, g.draw(st.integers(0, 5), label="steps"))
    run_program(prog, seed, STATS["matmul"])


@PROFILE
@given(data=st.data())
def _reshards(data):
    """A placed input, then annotations (with an op or two between) asking for other layouts:
    every row of the reshard table, over either mesh axis, with and without streaming."""
    mesh_key, streams, dtype, seed = common_draws(data, MESHES_2D + MESHES_2D + MESHES_1D)
    g = Gen(data, mesh_key, dtype, streams)
    x = g.new_input(g.shape(g.pick([2, 3])), placed=True)
    kinds = ["annotate", "annotate", "annotate", "unary", "reduce", "matmul", "transpose"]
    cur = g.annotate(x)
    prog = g.body(cur, kinds, g.draw(st.integers(0, 4), label="steps"), branch=0)
    run_program(prog, seed, STATS["reshards"])


@PROFILE
@given(data=st.data())
def _mixed_programs(data):
    mesh_key, streams, dtype, seed = common_draws(data, ALL_MESHES, f32=10)
    g = Gen(data, mesh_key, dtype, streams)
    x = g.new_input(g.shape(g.pick([2, 3, 1])))
    prog = g.body(x, list(Gen.STEPS) + ["annotate", "matmul"], g.draw(st.integers(1, 8), label="steps"),
                  branch=20, two_outputs=20)
    run_program(prog, seed, STATS["mixed"])


@PROFILE
@given(data=st.data())
def _moves_between_meshes(data):
    """Values moved between the mesh and its sub-meshes (pipeline stages), sharded there over
    one axis or a tuple of mesh axes in either order, with ops, reshapes and streams on either side."""
    mesh_key, streams, dtype, seed = common_draws(data, ["2x2", "4", "2x4", "2"])
    g = Gen(data, mesh_key, dtype, streams)
    x = g.new_input(g.shape(g.pick([2, 3])), placed=g.chance(70))
    cur = g.move(g.maybe_annotate(x, 50))
    kinds = ["move", "annotate", "unary", "reshape", "move", "matmul", "binary", "reduce", "transpose", "move"]
    prog = g.body(cur, kinds, g.draw(st.integers(0, 5), label="steps"), branch=10)
    run_program(prog, seed, STATS["moves"])


def test_elementwise_and_reduction_chains():
    _drive(_elementwise_and_reductions, "elementwise")


def test_matmul_chains():
    _drive(_matmul_chains, "matmul")


def test_reshards_on_1d_and_2d_meshes():
    _drive(_reshards, "reshards")


def test_mixed_programs():
    _drive(_mixed_programs, "mixed")


def test_moves_between_meshes():
    _drive(_moves_between_meshes, "moves")
