"""The layers are visible in the files and nothing lower imports anything higher:
kernels (pure) <- pure rules <- transport (the only MPI module) <- server/client <- training <- CLI."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def _package(folder: str, package: str, layer: int) -> dict:
    return {f"{package}.{m[:-3]}": layer for m in os.listdir(os.path.join(ROOT, folder))
            if m.endswith(".py") and m not in ("__init__.py", "__main__.py")}


LEVEL = {  # module -> layer: the packages say it (hpcps/ps's pure modules, then its transport, then the rest)
    **_package("kernels", "hpcps_kernels", 0),
    **{f"hpcps.{m}": 1 for m in ("config", "malloc", "errors", "outputs")},
    **{f"hpcps.ps.{m}": 1 for m in ("layout", "placement", "protocol", "tables", "signals", "checkpoint",
                                    "store", "policies", "server_table", "consistency", "margins", "deltas", "filters",
                                    "replication", "mpi_env", "start_up")},
    "hpcps.ps.transport": 2,
    **{f"hpcps.ps.{m}": 3 for m in ("server", "plain_requests", "quick_requests", "quick_steps", "client", "context", "collectives", "recovery",
                                    "failover", "rereplication")},
    **_package("hpcps/train", "hpcps.train", 4),
    **_package("hpcps/bench", "hpcps.bench", 5),
    **{f"hpcps.{m}": 5 for m in ("cli", "supervise", "plot")},
}


def imports_of(path: str, package: str) -> set[str]:
    tree = ast.parse(open(path).read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def modules():
    for folder, package in (("kernels", "hpcps_kernels"), ("hpcps", "hpcps"), ("hpcps/ps", "hpcps.ps"),
                            ("hpcps/train", "hpcps.train"), ("hpcps/bench", "hpcps.bench")):
        for name in os.listdir(os.path.join(ROOT, folder)):
            if name.endswith(".py") and name not in ("__init__.py", "__main__.py"):
                yield f"{package}.{name[:-3]}", os.path.join(ROOT, folder, name), package


def test_every_module_has_a_layer():
    assert {m for m, _, _ in modules()} <= set(LEVEL)


def test_no_module_imports_a_higher_layer():
    bad = []
    for mod, path, package in modules():
        for imp in imports_of(path, package):
            if imp in LEVEL and LEVEL[imp] > LEVEL[mod]:
                bad.append(f"{mod} (layer {LEVEL[mod]}) imports {imp} (layer {LEVEL[imp]})")
    assert not bad, "\n".join(bad)


def test_only_transport_imports_mpi4py_and_kernels_import_no_hpcps():
    for mod, path, package in modules():
        imps = imports_of(path, package)
        if mod != "hpcps.ps.transport":
            assert not any(i == "mpi4py" or i.startswith("mpi4py.") for i in imps), mod
        if mod.startswith("hpcps_kernels."):
            assert not any(i == "hpcps" or i.startswith("hpcps.") for i in imps), mod


def test_training_and_the_command_line_talk_to_the_context_not_the_transport():
    """Training and the CLI agree, gather and abort through hpcps.ps.collectives (the context's
    and the world's methods named for what they mean), never through the transport itself."""
    bad = [mod for mod, path, package in modules()
           if (mod.startswith("hpcps.train.") or mod == "hpcps.cli")
           and any(i == "hpcps.ps.transport" or i.startswith("hpcps.ps.transport.") for i in imports_of(path, package))]
    assert not bad, f"these import hpcps.ps.transport: {bad}"


# Methods of mpi4py communicators and requests that communicate or wait. Outside the transport
# module none may be called: every wait goes through hpcps.ps.transport, with a timeout, a stall
# warning and no spinning (Get_rank and Get_size ask nothing of other ranks and are allowed).
_CAPITALISED = ("Send", "Recv", "Isend", "Irecv", "Sendrecv", "Bcast", "Gather", "Gatherv", "Scatter",
                "Allgather", "Allreduce", "Reduce", "Barrier", "Alltoall", "Probe", "Iprobe", "Mprobe", "Improbe",
                "Test", "Wait", "Waitall", "Testall", "Waitany", "Split", "Dup", "Free", "Abort", "Ibarrier",
                "Iallreduce", "Ibcast", "Igatherv", "Iallgather", "Start")
# mpi4py's pickling methods (lower case); "split", "free" and the like are left out, as str.split is no MPI
_PICKLING = ("send", "recv", "isend", "irecv", "sendrecv", "bcast", "gather", "scatter", "allgather", "allreduce",
             "barrier", "alltoall", "probe", "iprobe", "mprobe", "improbe")
MPI_CALLS = set(_CAPITALISED) | set(_PICKLING)


def test_no_communicator_method_is_called_outside_the_transport():
    bad = []
    for mod, path, _ in modules():
        if mod == "hpcps.ps.transport" or mod.startswith("hpcps_kernels."):
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MPI_CALLS:
                owner = ast.unparse(node.func.value)
                if owner == "transport":
                    continue
                bad.append(f"{mod}:{node.lineno}: {owner}.{node.func.attr}(...)")
    assert not bad, "communicator calls outside hpcps/ps/transport.py:\n" + "\n".join(bad)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_private_names(tree) -> set[str]:
    """The private names a module defines: its functions, classes and methods, the names it
    assigns, and the attributes it assigns (``self._x = ...``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if _private(n)}


def _module_aliases(tree, project: set[str]) -> set[str]:
    """The names under which a module refers to the project's modules (``from hpcps.train import
    data as tdata``: ``tdata``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in project}
        elif isinstance(node, ast.Import):
            out |= {a.asname for a in node.names if a.name in project and a.asname}
    return out


def test_no_module_reaches_another_modules_private_names():
    """No ``other_module._name`` and no ``obj._name`` of a private name another module defines
    (``self``/``cls`` reach their own; a module uses its own private names as it likes), and no
    ``from module import _name``: what a module offers the others is its public names."""
    trees = {mod: (ast.parse(open(path).read()), package) for mod, path, package in modules()}
    own = {mod: _own_private_names(tree) for mod, (tree, _) in trees.items()}
    bad = []
    for mod, (tree, package) in trees.items():
        others = set().union(*(names for m, names in own.items() if m != mod)) - own[mod]
        aliases = _module_aliases(tree, set(trees))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and (
                    node.attr in others or isinstance(node.value, ast.Name) and node.value.id in aliases):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                    continue
                bad.append(f"{mod}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(("hpcps", "hpcps_kernels"))):
                bad += [f"{mod}:{node.lineno}: from {node.module} import {a.name}" for a in node.names if _private(a.name)]
    assert not bad, "private names reached across modules:\n" + "\n".join(sorted(bad))


MAX_CLASS_LINES, MAX_FUNCTION_LINES = 200, 80


def test_no_class_over_200_lines_and_no_function_over_80():
    """Each responsibility in a unit a reader can hold: classes of at most about 200 lines
    (docstrings included) and functions of at most 80."""
    over = []
    for mod, path, _ in modules():
        for node in ast.walk(ast.parse(open(path).read())):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            name = f"{mod}.{getattr(node, 'name', '')}"
            if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
                over.append(f"class {name}: {lines} lines")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > MAX_FUNCTION_LINES:
                over.append(f"function {name} (line {node.lineno}): {lines} lines")
    assert not over, "\n".join(over)
