"""Architecture invariants (issue 13, item 6; /work/shared/ARCHITECTURE.md, "Invariants to pin").

AST / import / inspection checks over `shardfuse/` and `backends/` (installed as `shardfuse.backends`),
and a few golden plans run on the NumPy backend: no GPU, no CuPy, fast.  They pin what the refactor
promises, so that it cannot quietly come undone: 1. the backend Protocol is complete; 2. every backend
conforms to it; 3. one op vocabulary (`ops.Op`, and the tables keyed by it); 4. layering (no cycle, no
import going up, lazy imports included); 5. no private names across modules; 6. the plan is what runs
(`plan.collectives()` == the collectives the executor binds); 7. files and functions of bounded size (no
total budget); 8. IR attributes are plain data, programs print, and instructions are never changed
after they are made; 9. no hidden state (no `__dict__` keys; the run-time state a mesh declares is
set by its owner only; nothing keeps a used mesh alive).  Each test lists every violation it finds
(file:line where there is one).
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import sys
from pathlib import Path

import numpy as np

import shardfuse as sf
from shardfuse import ops
from shardfuse.ops import Op

ROOT = Path(__file__).resolve().parents[1]
STDLIB = sys.stdlib_module_names
FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)

def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "backends":  # installed as shardfuse.backends (pyproject.toml, package-dir)
        parts = ["shardfuse", "backends"] + parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

def _files(*dirs):
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)

SOURCES = {_module_name(p): p for p in _files("shardfuse", "backends")}

@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))

def _where(path: Path, node) -> str:
    return f"{path.relative_to(ROOT)}:{node.lineno}"

def _report(what: str, violations) -> str:  # in file and line order
    violations = sorted(violations, key=lambda v: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", v)])
    return f"{len(violations)} {what}:\n  " + "\n  ".join(violations)

def _params(fn) -> list:  # without self
    return [x.arg for x in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs][1:]

def _targets(st) -> list:
    return st.targets if isinstance(st, ast.Assign) else [st.target] if isinstance(st, ast.AnnAssign) else []

# ---- 1. the protocol is complete ----------------------------------------------------------------
def _protocol_members() -> dict:
    """name -> parameter names (a method) or None (an annotated attribute), from the class body."""
    cls = next(n for n in _tree(SOURCES["shardfuse.backends.protocol"]).body
               if isinstance(n, ast.ClassDef) and n.name == "Backend")
    out = {st.target.id: None for st in cls.body if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)}
    return out | {st.name: _params(st) for st in cls.body if isinstance(st, FUNCS)}

def _is_backend(node) -> bool:
    """`be`, `backend`, `<anything>.backend` or `backend_of(...)`: an expression naming a backend."""
    return (isinstance(node, ast.Name) and node.id in ("be", "backend")
            or isinstance(node, ast.Attribute) and node.attr == "backend"
            or isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "backend_of")

def test_1_protocol_is_complete():
    members, bad = _protocol_members(), []
    for path in SOURCES.values():
        for n in ast.walk(_tree(path)):
            name = n.attr if isinstance(n, ast.Attribute) and _is_backend(n.value) else None
            if (isinstance(n, ast.Call) and getattr(n.func, "id", None) in ("getattr", "hasattr", "setattr")
                    and len(n.args) >= 2 and _is_backend(n.args[0]) and isinstance(n.args[1], ast.Constant)):
                name = n.args[1].value  # getattr(backend, "x", default) reads it too
            if name is not None and name not in members:
                bad.append(f"{_where(path, n)}: backend.{name} is not a member of protocol.Backend")
    assert not bad, _report("backend attributes read outside the Protocol", bad)

# ---- 2. every backend conforms ------------------------------------------------------------------
BACKENDS = [("shardfuse.backends.numpy_local", "NumpyLocalBackend"),
            ("shardfuse.backends.numpy_mpi", "NumpyMPIBackend"),
            ("shardfuse.backends.cupy_nccl", "CupyNcclBackend")]

def _resolve_base(mod: str, base) -> tuple | None:
    """(module, class) of a base class named in mod: defined there, or imported by name."""
    tree, name = _tree(SOURCES[mod]), getattr(base, "id", None)
    if any(isinstance(n, ast.ClassDef) and n.name == name for n in tree.body):
        return mod, name
    return next(((n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module in SOURCES
                 for a in n.names if (a.asname or a.name) == name), None)

def _class_members(mod: str, name: str, problems: list) -> dict:
    """name -> parameter names (a plain method) or None (an attribute or property), bases first."""
    cls = next(n for n in _tree(SOURCES[mod]).body if isinstance(n, ast.ClassDef) and n.name == name)
    out: dict = {}
    for base in cls.bases:
        if (where := _resolve_base(mod, base)) and where[0].startswith("shardfuse.backends"):
            out.update(_class_members(*where, problems))
        elif ast.unparse(base) != "object":
            problems.append(f"{name}: base {ast.unparse(base)} is not a class found in backends/")
    for st in cls.body:
        out.update({n.id: None for t in _targets(st) for n in ast.walk(t) if isinstance(n, ast.Name)})
        if isinstance(st, FUNCS):
            prop = any(ast.unparse(d).endswith(("property", ".setter")) for d in st.decorator_list)
            out[st.name] = None if prop else _params(st)
            for t in (t for n in ast.walk(st) for tt in _targets(n) for t in ast.walk(tt)):  # self.x = ...
                if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self":
                    out.setdefault(t.attr, None)
    return out

def test_2_every_backend_conforms():
    from shardfuse.backends.numpy_local import NumpyLocalBackend
    from shardfuse.backends.protocol import Backend
    proto, bad = _protocol_members(), []
    for mod, name in BACKENDS:  # by AST: no CuPy or MPI needed
        have = _class_members(mod, name, bad)
        for m, params in proto.items():
            if m not in have:
                bad.append(f"{name}.{m}: missing")
            elif params is not None and have[m] != params:
                bad.append(f"{name}.{m}{tuple(have[m]) if have[m] is not None else ' (not a method)'}: "
                           f"the Protocol says {m}{tuple(params)}")
    be = NumpyLocalBackend(sf.DeviceMesh(2, backend="numpy"))  # and by import: runtime_checkable + inspect
    if not isinstance(be, Backend):
        bad.append("isinstance(NumpyLocalBackend(mesh), protocol.Backend) is False")
    for m, params in ((m, p) for m, p in proto.items() if p is not None and callable(getattr(be, m, None))):
        if (got := list(inspect.signature(getattr(be, m)).parameters)) != params:
            bad.append(f"NumpyLocalBackend.{m}{tuple(got)} (inspect): the Protocol says {m}{tuple(params)}")
    assert not bad, _report("differences from protocol.Backend", bad)

# ---- 3. one op vocabulary -----------------------------------------------------------------------
# Strings spelled like an op that are not one, by (file, string), each with its reason.
OP_STRING_ALLOWED = {
    **{("shardfuse/__init__.py", f): "__all__ names the public functions sf.exp, sf.gelu, ...: not ops"
       for f in ("exp", "gelu", "relu", "tanh", "sqrt", "rsqrt", "log", "sigmoid", "silu", "maximum", "minimum",
                 "logical_not")},
    ("shardfuse/placements.py", "sum"): "Partial(reduce_op='sum'): DTensor's reduce-op name, public API",
    ("shardfuse/numpy_math.py", "tanh"): "sf.gelu(approximate='tanh'): torch's argument value, public API",
    ("shardfuse/nn.py", "sum"): "sf.nn.cross_entropy(reduction='sum'): torch's argument value, public API",
}

def test_3a_no_op_name_strings_outside_ops():
    values, bad = {op.value for op in Op}, []
    for path in (p for m, p in SOURCES.items() if m != "shardfuse.ops"):
        tree, rel = _tree(path), str(path.relative_to(ROOT))
        # docstrings and other bare strings; the pieces of an f-string (a message, not a name)
        skip = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        skip |= {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        bad += [f"{_where(path, n)}: {n.value!r} (write Op.{Op(n.value).name})" for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in values
                and id(n) not in skip and (rel, n.value) not in OP_STRING_ALLOWED]
    assert not bad, _report("op names spelled as strings", bad)

# (executor.BIND covers ops.HOST but For, which ir.unroll unrolls: executor.py asserts it at import, so
# every test fails when it does not.)

def test_3c_every_op_prints():
    from shardfuse.ir import Instr, TensorType, Value, format_instrs
    from shardfuse.layout import Layout
    from shardfuse.streams import MAIN
    a, b, y, buf = (Value(n, TensorType((4, 4), "float32", Layout.replicated(2))) for n in ("a", "b", "y", "buf"))
    attrs = {"var": "i", "extent": 2, "axis": 0, "to_axis": 1, "team": "DIDx", "stream": MAIN, "index": 0,
             "kind": "SendRecv", "shift": 1, "perm": (1, 0), "from": (0,), "to": (0,), "value": 2.0}
    writes = ops.COMMUNICATION | ops.ELEMENTWISE | {Op.MATMUL, Op.SUM, Op.COPY, Op.TAKE, Op.SCATTER_ADD, Op.FUSED,
                                                          Op.FUSED_SUM, Op.FUSED_ROWS, Op.DYNAMIC_SLICE,
                                                          Op.DYNAMIC_UPDATE_SLICE}
    bad = []  # (writes: the host ops that write into a buffer)
    for level, group in (("host", ops.HOST), ("array", ops.ARRAY)):
        for op in sorted(group):
            into = buf if level == "host" and op in writes else None
            i = Instr(op, outs=(y,), ins=(a, b), attrs=dict(attrs), into=into)
            try:
                line = "\n".join(format_instrs([i])).strip()
            except Exception as e:  # noqa: BLE001 (reported)
                bad.append(f"{level} {op}: printing raised {type(e).__name__}: {e}")
                continue
            raw = ("<Op", "Op.", "Instr(", " object at 0x") + ((f"{op.value}(",) if level == "host" else ())
            if not line or any(r in line for r in raw):  # a host op in the traced form has no entry
                bad.append(f"{level} {op}: printed {line!r} (raw, or the generic array-level form)")
    assert not bad, _report("ops without a printer entry", bad)

def test_3d_every_array_op_has_a_rule():
    from shardfuse import rules
    missing = sorted(map(str, ops.ARRAY - set(rules.RULES)))
    assert not missing, f"no rules.RULES entry for {missing}"

def test_3e_verify_rejects_an_op_that_is_not_an_op():
    from shardfuse.passes.verify import verify
    _, f, args, _ = _golden(1)[0]
    prog = f.lower(*args).program
    i = next(i for i in prog.instrs if i.op == Op.ALLOCATE)
    edited = prog.with_instrs([dataclasses.replace(i, op=str(i.op)) if j is i else j for j in prog.instrs], "edit")
    try:
        verify(edited)
    except Exception:  # noqa: BLE001 (any refusal will do)
        return
    raise AssertionError(f"verify accepted Instr(op={str(i.op)!r}): a str, not an ops.Op")

# ---- 4. layering --------------------------------------------------------------------------------
BOTTOM = {f"shardfuse.{m}" for m in ("dtypes", "ops", "strides", "mesh", "placements", "sharding", "layout", "schedule", "streams", "spec",
                                    "faults", "fault_messages")}
BOTTOM_THIRD_PARTY = {"numpy", "mpi4py", "ml_dtypes", "cupy"}  # besides the standard library (cupy: mesh.gpu_count)
RUN_TIME = {f"shardfuse.{m}" for m in ("executor", "jit", "plan", "array", "api", "runtime")} | {"shardfuse"}  # (re-exports)

def _imports(mod: str):
    """(target module, node) for every import in mod, those inside functions too; `from shardfuse
    import faults` is an edge to shardfuse.faults (not the package), one edge per target and line."""
    path = SOURCES[mod]
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for n in ast.walk(_tree(path)):
        if isinstance(n, ast.Import):
            yield from ((a.name, n) for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            up = package.split(".")[: len(package.split(".")) - n.level + 1] + [n.module] * bool(n.module)
            base = ".".join(up) if n.level else n.module
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in SOURCES else base for a in n.names]
            yield from ((t, n) for t in dict.fromkeys(names))

def _cycles(graph: dict) -> list:
    """The import cycles: groups of modules that each reach all the others."""
    def reach(m, seen):
        for w in graph.get(m, ()):
            if w not in seen:
                seen.add(w)
                reach(w, seen)
        return seen
    r = {m: reach(m, set()) for m in graph}
    return sorted({tuple(sorted(w for w in r[m] if m in r.get(w, ()))) for m in graph if m in r[m]})

def _in_backends(m: str) -> bool:
    return m == "shardfuse.backends" or m.startswith("shardfuse.backends.")

LAYER_RULES = [  # (rule, broken(importer, imported module of shardfuse))
    ("the bottom floor imports only itself", lambda m, t: m in BOTTOM and t not in BOTTOM),
    ("ir imports only the bottom floor", lambda m, t: m == "shardfuse.ir" and t not in BOTTOM),
    ("the compiler never imports the run time or backends",
     lambda m, t: (m == "shardfuse.rules" or m.startswith("shardfuse.passes")) and (t in RUN_TIME or _in_backends(t))),
    ("backends import only backends.*, the bottom floor and interop",
     lambda m, t: _in_backends(m) and not (_in_backends(t) or t in BOTTOM or t == "shardfuse.interop")),
    ("only shardfuse.runtime imports backends (the executor, the profiler and bench: backends.protocol too)",
     lambda m, t: not _in_backends(m) and _in_backends(t) and m != "shardfuse.runtime" and not (
         t == "shardfuse.backends.protocol" and (m in ("shardfuse.executor", "shardfuse.timeline")
                                                 or m.startswith("shardfuse.bench")))),
]

def test_4_layering():
    graph, bad = {}, []
    for mod, path in SOURCES.items():
        for t, node in _imports(mod):
            edge = f"{_where(path, node)}: {mod} -> {t}"
            if t != "shardfuse" and not t.startswith("shardfuse."):
                if mod in BOTTOM and t.split(".")[0] not in STDLIB | BOTTOM_THIRD_PARTY:
                    bad.append(f"{edge} (the bottom floor imports only the standard library, numpy, mpi4py)")
                continue
            if t != mod:
                graph.setdefault(mod, set()).add(t)
            bad += [f"{edge} ({rule})" for rule, broken in LAYER_RULES if broken(mod, t)]
    for comp in _cycles(graph):
        edges = sorted(f"{a} -> {b}" for a in comp for b in graph.get(a, ()) if b in comp)
        bad.append(f"import cycle among {', '.join(comp)}: " + "; ".join(edges))
    assert not bad, _report("layering violations", bad)

# ---- 5. no private names across modules ---------------------------------------------------------
# (file, private name) reached on purpose, each with its reason: deliberate fault injection only.
PRIVATE_ALLOWED = {
    ("tests/test_gpu.py", "_comms"): "aborts the NCCL communicators so that the next NCCL call fails",
    ("tests/test_inputs.py", "_rebuild_array"): "forges a pickle made by another MPI process",
    ("tests/test_gpu_interop.py", "_sleep"): "torch.cuda._sleep: a late producer injected on torch's stream",
    ("shardfuse/interop.py", "_C"): "torch._C._cuda_getCurrentRawStream: torch's current stream without a Stream object",
    ("backends/cuda/graphs.py", "_accelerator"): "CuPy's CUB switch (CUPY_ACCELERATORS at run time): no public "
                                                 "API; CUB's temporaries are refused inside a graph capture",
    ("backends/cuda/kernels.py", "_accelerator"): "whether CUB is off (a graph capture turned it off): CuPy's own "
                                                  "min kernel then, which needs no temporary",
}
NAMEDTUPLE_API = {"_asdict", "_replace", "_fields", "_make", "_field_defaults",  # public despite the _
                  "_repr_html_", "_repr_png_", "_repr_svg_"}  # (and IPython's rich display protocol)

def _private(name: str) -> bool:  # not a dunder, nor namedtuple's API
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and name not in NAMEDTUPLE_API

def _own_names(tree) -> set:
    """What this file defines: module-level names, and the members of its classes (methods, class
    attributes, self.x = ...).  Reaching those from within the file is not across modules."""
    classes = [c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)]
    own = {n.name for c in [tree] + classes for n in c.body if isinstance(n, FUNCS + (ast.ClassDef,))}
    own |= {x.id for st in tree.body + [s for c in classes for s in c.body]
            for t in _targets(st) for x in ast.walk(t) if isinstance(x, ast.Name)}
    return own | {x.attr for st in ast.walk(tree) for t in _targets(st) for x in ast.walk(t)
                  if isinstance(x, ast.Attribute) and getattr(x.value, "id", None) == "self"}

def test_5_no_private_names_across_modules():
    bad = []
    for path in _files("shardfuse", "backends", "tests"):
        tree, rel = _tree(path), str(path.relative_to(ROOT))
        own = _own_names(tree) | {"self", "cls"} | STDLIB
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and _private(n.attr) and (rel, n.attr) not in PRIVATE_ALLOWED:
                x = n.value
                if n.attr in own or isinstance(x, ast.Name) and x.id in own:
                    continue  # this file's own names and members, self, cls, sys._getframe / os._exit
                if not (isinstance(x, ast.Call) and getattr(x.func, "id", None) == "super"):
                    bad.append(f"{_where(path, n)}: {ast.unparse(n)}")
            elif isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] not in STDLIB:
                bad += [f"{_where(path, n)}: from {n.module} import {a.name}" for a in n.names
                        if _private(a.name) and (rel, a.name) not in PRIVATE_ALLOWED]
    assert not bad, _report("private names reached across modules", bad)

# ---- 6. the plan is what runs -------------------------------------------------------------------
def _golden(d: int):
    """(name, jitted function, arguments, NumPy reference) on a NumPy mesh of d devices."""
    from shardfuse.mlp import mlp_block, mlp_inputs, mlp_reference
    mesh, rng = sf.DeviceMesh(d, backend="numpy"), np.random.default_rng(d)
    r = rng.standard_normal  # float64
    def seed(a, b):  # AllGather+GEMM, pipelined in chunks
        return sf.stream(sf.shard(a, axis=1) @ b, axis=0, chunks=4)
    def reshard(x):  # S(0) -> S(1): an AllToAll
        return sf.shard(sf.shard(x, axis=0) * 2.0, axis=1)
    def reduce_scatter(a, b):  # a pending sum, resolved sharded
        return sf.shard(sf.shard(a, axis=1) @ sf.shard(b, axis=0), axis=0)
    return [
        ("seed", sf.jit(seed, mesh=mesh, streams=2), (r((8, d, 4, 16)), r((16, 8))), lambda a, b: a @ b),
        ("mlp_tp", mlp_block(mesh, "tp", chunks=2), tuple(mlp_inputs(rng, 8, 8)), mlp_reference),
        ("reshard", sf.jit(reshard, mesh=mesh), (r((8, 12, 5)),), lambda x: 2.0 * x),
        ("reduce_scatter", sf.jit(reduce_scatter, mesh=mesh), (r((8, 16)), r((16, 8))), lambda a, b: a @ b),
    ]

COUNTED = ("allgather", "allreduce", "reduce_scatter", "alltoall", "sendrecv", "transfers")

def _counting_backend(mesh):
    """The reference backend, counting the collectives bound through it (bind_<kind> calls)."""
    from shardfuse.backends.numpy_local import NumpyLocalBackend
    def counted(kind, base):
        def bind(self, *args):
            self.counts[kind] = self.counts.get(kind, 0) + 1
            return base(self, *args)
        return bind
    methods = {f"bind_{k}": counted(k, getattr(NumpyLocalBackend, f"bind_{k}")) for k in COUNTED}
    counting = type("Counting", (NumpyLocalBackend,), methods)(mesh)
    counting.counts = {}
    return counting

def _gathered(prog, out):
    """The global result of an Executable call ((layout, pieces) per output, wrapped as jit.Plan does)."""
    if not isinstance(out, sf.Array):
        ((lay, shards, _),), (v,) = out, prog.outputs
        out = sf.Array(prog.mesh, v.type.shape, v.type.dtype, lay, shards)
    return out.gather()

def test_6_plan_collectives_are_what_the_executor_binds():
    from shardfuse.executor import Executable
    bad = []
    for d in (1, 4):
        for name, f, args, ref in _golden(d):
            plan, be = f.lower(*args), _counting_backend(f.mesh)
            out = Executable(plan.program, be)(*args)
            said, bound = plan.collectives(), be.counts
            if sum(said.values()) != sum(bound.values()) or any(said.get(k, 0) != bound.get(k, 0) for k in COUNTED[:4]):
                bad.append(f"{name} D={d}: plan.collectives() = {said}, the executor bound {bound}")
            got, want = _gathered(plan.program, out), ref(*args)
            if not np.allclose(got, want, rtol=1e-10, atol=1e-10):
                bad.append(f"{name} D={d}: wrong result, max error {np.max(np.abs(got - want)):.3g}")
    assert not bad, _report("plans that do not run as printed", bad)

# ---- 7. file and function sizes -----------------------------------------------------------------
# Limits that keep a file or a function readable in one sitting.  There is no total line budget (there
# was one until issue 30): a budget on the whole invites code golf, conditional one-liners written to
# fit it, and a line that says one thing is worth more than the line it saves.
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 80

def test_7_file_and_function_sizes():
    bad = []
    for path in SOURCES.values():
        lines = len(path.read_text().splitlines())
        if lines > MAX_FILE_LINES:
            bad.append(f"{path.relative_to(ROOT)}: {lines} lines > {MAX_FILE_LINES}")
        for n in ast.walk(_tree(path)):
            if isinstance(n, FUNCS) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES:
                bad.append(f"{_where(path, n)}: {n.name} is {n.end_lineno - n.lineno + 1} lines > {MAX_FUNCTION_LINES}")
    assert not bad, _report("files or functions over their size limit", bad)

# ---- 8. IR attributes are plain data ------------------------------------------------------------
def _plain(x, ok_types) -> bool:
    """Builtin None / bool / int / float / str, tuples, frozensets, dicts of those, or ok_types."""
    if type(x) in (tuple, frozenset, dict):
        return all(_plain(v, ok_types) for v in ([*x.keys(), *x.values()] if type(x) is dict else x))
    return (x is None or type(x) in (bool, int, float, str) or isinstance(x, ok_types)) and not callable(x)

def test_8_ir_attributes_are_plain_data():
    """No Value inside attrs either: the values an instruction reads, writes or makes are its
    fields (ins, into, outs, a loop's results), which substitute() renames and walks see."""
    from shardfuse.ir import Idx
    from shardfuse.jit import trace
    from shardfuse.layout import Layout
    from shardfuse.passes import PIPELINE
    from shardfuse.schedule import Schedule
    from shardfuse.streams import Stream
    ok_types, bad = (Op, ops.Expr, Idx, Layout, Schedule, Stream, sf.DeviceMesh), []
    for d in (1, 4):
        for name, f, args in [(name, f, args) for name, f, args, _ in _golden(d)] + _ring_case(d):
            prog = trace(f.fn, f.mesh, [sf.TensorSpec(a.shape, "float64") for a in args], f.streams)
            for p in (None,) + tuple(PIPELINE):  # every stage, from the traced program to the plan
                prog, where = (p(prog) if p else prog), f"{name} D={d} after {p.__name__ if p else 'trace'}"
                bad += [f"{where}: {i.op}.attrs[{k!r}] = {v!r} ({type(v).__name__})"
                        for i in prog.walk() for k, v in i.attrs.items() if not _plain(v, ok_types)]
                try:
                    str(prog), [str(i) for i in prog.walk()]
                except Exception as e:  # noqa: BLE001 (reported)
                    bad.append(f"{where}: printing raised {type(e).__name__}: {e}")
    assert not bad, _report("IR attributes that are not plain data, or programs that do not print", bad)

def _ring_case(d: int) -> list:
    """[(name, jitted function, arguments)]: the ring variant (a loop a pass schedules itself)."""
    mesh = sf.DeviceMesh(d, backend="numpy")
    ring = sf.jit(lambda x, w: sf.stream(sf.shard(x, axis=0) @ w, axis=0, chunks=d, algorithm="ring"), mesh=mesh)
    return [("ring", ring, (np.ones((4 * d, 8)), np.ones((8, 4))))]

# (file, attrs key) written into an instruction that was already made, each with its reason: to be emptied.
ATTRS_WRITE_ALLOWED = {}  # (empty: the ring's chunks are the Schedule _annotate makes)

def _attrs_writes(tree):
    """(node, key) for every write into `<expr>.attrs`: x.attrs[k] = / += / del, x.attrs.update(...) & co."""
    for n in ast.walk(tree):
        targets = _targets(n) + ([n.target] if isinstance(n, ast.AugAssign) else []) + (
            n.targets if isinstance(n, ast.Delete) else [])
        for t in targets:
            if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and t.value.attr == "attrs":
                yield n, t.slice.value if isinstance(t.slice, ast.Constant) else ast.unparse(t.slice)
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Attribute)
                and n.func.value.attr == "attrs" and n.func.attr in ("update", "pop", "popitem", "setdefault", "clear")):
            yield n, f".{n.func.attr}()"

def test_8b_instructions_are_never_changed():
    """ir.py's promise: passes build new instructions instead of editing old ones.  By the code (no
    write into an instruction's attrs) and by running: every stage's instructions keep their
    attributes while the later passes run."""
    from shardfuse.jit import trace
    from shardfuse.passes import PIPELINE
    bad = []
    for path in SOURCES.values():
        rel = str(path.relative_to(ROOT))
        bad += [f"{_where(path, n)}: writes attrs[{key!r}] of a made instruction" for n, key in _attrs_writes(_tree(path))
                if (rel, key) not in ATTRS_WRITE_ALLOWED]
    cases = [(name, f, args) for name, f, args, _ in _golden(4)] + _ring_case(4)
    for name, f, args in cases:
        prog = trace(f.fn, f.mesh, [sf.TensorSpec(a.shape, "float64") for a in args], f.streams)
        seen = []  # (stage, instruction, a copy of its attrs when the stage was made)
        for p in (None,) + tuple(PIPELINE):
            prog = p(prog) if p else prog
            seen += [(p.__name__ if p else "trace", i, dict(i.attrs)) for i in prog.walk()]
        bad += [f"{name}: an instruction {i.op} made by {stage} was changed later: {was} -> {i.attrs}"
                for stage, i, was in seen if i.attrs != was]
    assert not bad, _report("instructions changed after they were made", bad)

# ---- 9. no hidden state -------------------------------------------------------------------------
# The run-time state a mesh object holds (mesh.py declares it and says why it is on the mesh), each
# attribute with the one module that fills it.
MESH_STATE_OWNERS = {"backend_cache": "shardfuse.runtime", "submesh_backend_cache": "shardfuse.runtime",
                     "op_plan_cache": "shardfuse.array_ops"}

def _mesh_in_use():
    """A mesh, a sub-mesh of it, and what uses them: placements on both (the placement memo), a
    one-op plan, jitted calls (backends, plans), a result whose layout names the sub-mesh."""
    mesh = sf.DeviceMesh(4, backend="numpy")
    sub = mesh.submesh([2, 1])
    x = np.arange(8.0)
    on_sub, on_mesh = sf.shard(x, 0, mesh=sub), sf.shard(x, 0, mesh=mesh)
    moved = sf.jit(lambda a: sf.shard(a, 0, mesh=sub) * 2.0, mesh=mesh)(on_mesh)
    results = [(on_mesh * 2.0).gather(), on_sub.gather(), moved.addressable_shards, moved.gather()]
    return mesh, sub, results

def test_9_no_hidden_state():
    import gc
    import weakref
    bad = []
    for mod, path in SOURCES.items():  # state under string keys slips past every other check
        for n in ast.walk(_tree(path)):
            if isinstance(n, ast.Attribute) and n.attr == "__dict__":
                bad.append(f"{_where(path, n)}: {ast.unparse(n)} (declare the attribute instead)")
            for t in (t for tt in _targets(n) for t in ast.walk(tt)):
                owner = MESH_STATE_OWNERS.get(getattr(t, "attr", None))
                if isinstance(t, ast.Attribute) and owner not in (None, mod) and mod != "shardfuse.mesh":
                    bad.append(f"{_where(path, t)}: {ast.unparse(t)} is set outside {owner}, which owns it")
    declared = set(vars(sf.DeviceMesh(4, backend="numpy")))
    if not set(MESH_STATE_OWNERS) <= declared:
        bad.append(f"mesh.py does not declare {sorted(set(MESH_STATE_OWNERS) - declared)}")
    mesh, sub, results = _mesh_in_use()
    bad += [f"{m} got attributes mesh.py does not declare: {sorted(set(vars(m)) - declared)}"
            for m in (mesh, sub) if set(vars(m)) != declared]
    gone = weakref.ref(mesh)
    del mesh, sub, results
    gc.collect()
    if gone() is not None:  # a module-level table (a memo, a cache) that holds a mesh keeps it for ever
        bad.append("a mesh in use is kept alive after its last use: " + ", ".join(
            type(r).__name__ for r in gc.get_referrers(gone()) if not isinstance(r, type(sys._getframe()))))
    assert not bad, _report("pieces of hidden state", bad)
