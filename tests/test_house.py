"""The house as the imports draw it: oracle/ (the reference) imports nothing of fast/ or tools/;
fast/ (the engine's API) imports nothing of tools/; and no package has an import circle.

Imports are read from the source with `ast` (every `import` and `from ... import`, at any depth:
a lazy import inside a function is an import all the same)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("oracle", "fast", "tools")
# who may import whom: a package above may import the ones below, never the reverse
ALLOWED = {"oracle": {"oracle"}, "fast": {"fast", "oracle"}, "tools": {"tools", "fast", "oracle"}}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Fully qualified names of the project modules that `path` imports (`from pkg import sub` counts
    as an import of the module pkg.sub, and of pkg itself only when a name is not a submodule)."""
    modules = _module_names()
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                found.add(sub if sub in modules else mod)
    return {m for m in found if m.split(".")[0] in PACKAGES}


def _module_names() -> set[str]:
    return set(project_modules())


def project_modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            mods[module_name(path)] = path
    return mods


def graph() -> dict[str, set[str]]:
    mods = project_modules()
    g = {}
    for name, path in mods.items():
        g[name] = {m for m in imports_of(path) if m in mods and m != name}
    return g


def test_layers_import_only_downward():
    bad = []
    for name, path in project_modules().items():
        top = name.split(".")[0]
        for m in imports_of(path):
            if m.split(".")[0] not in ALLOWED[top]:
                bad.append(f"{path.relative_to(ROOT)} imports {m}")
    assert not bad, "imports that run back up the house:\n  " + "\n  ".join(bad)


def find_cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def _ignoring_package_faces(g):
    """A package's __init__ that only hands names on is not a room: `import fast` then `fast.engine`
    importing `fast` (for `fast.EngineInputError`) is not a circle of code. Edges into a package's
    __init__ count only when that __init__ defines something itself."""
    faces = set()
    for name, path in project_modules().items():
        if path.name == "__init__.py":
            tree = ast.parse(path.read_text())
            defines = any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in tree.body)
            if not defines:
                faces.add(name)
    return {v: {w for w in ws if w not in faces} for v, ws in g.items() if v not in faces}


def test_no_import_circles():
    cycles = find_cycles(_ignoring_package_faces(graph()))
    assert not cycles, "import circles:\n  " + "\n  ".join(" <-> ".join(c) for c in cycles)


def test_the_checks_catch_what_they_claim():
    # the cycle finder finds a planted circle and the layering check reads lazy imports
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    src = "def f():\n    from fast import Engine\n"
    tree = ast.parse(src)
    assert any(isinstance(n, ast.ImportFrom) and n.module == "fast" for n in ast.walk(tree))


@pytest.mark.parametrize("pkg", PACKAGES)
def test_package_exists(pkg):
    assert (ROOT / pkg / "__init__.py").exists()
