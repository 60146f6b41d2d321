"""Import rules, read from the source (every import statement,
lazy ones included): no module imports another module's private (underscore) names, and the
kernels never import the speculative loop, which imports them (lazily): the finalise rule they
share is `mmgen.decoding.finalise`."""

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
#: Source folder -> the package it installs as (setup.py's FOLDERS).
PACKAGES = {"mmgen": "mmgen", "image_ar": "mmgen.image_ar", "vlm": "mmgen.vlm", "audio": "mmgen.audio",
            "video": "mmgen.video", "kernels": "mmgen.kernels", "apps": "mmgen.apps"}


def modules() -> dict[str, Path]:
    """Installed module name -> its source file."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path) -> list[tuple[str, str]]:
    """(module, name) of each `from module import name` in module `name`, relative ones resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(filter(None, [base, node.module]))
            found += [(module, alias.name) for alias in node.names]
    return found


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_imports_another_modules_private_names():
    found = []
    for name, path in modules().items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for module, imported in imports(name, path):
            # A package's own private modules (mmgen.kernels._triton) are its business.
            own_module = module.startswith(package + ".") and private(module.rpartition(".")[2])
            if module.startswith("mmgen") and private(imported) and module != name and not own_module:
                found.append(f"{path.relative_to(ROOT)}: from {module} import {imported}")
    assert not found, found


def test_the_kernels_never_reach_the_speculative_loop():
    """Module to module. `mmgen/decoding/__init__.py`, which re-exports every decoder, is not
    followed: it runs when any module of the package is first imported, so it says nothing about
    what the kernels themselves depend on (and `import mmgen.kernels` alone does not run it:
    mmgen's decoding names load on first use)."""
    known = modules()
    graph = {}
    for name, path in known.items():
        targets = set()
        for module, imported in imports(name, path):
            for target in (f"{module}.{imported}", module):
                if target in known:
                    targets.add(target)
                    break
        graph[name] = targets - {name}
    for start in (m for m in known if m.startswith("mmgen.kernels.")):
        seen, todo = {start}, [start]
        while todo:
            for target in graph[todo.pop()]:
                if target not in seen and target != "mmgen.decoding":
                    seen.add(target)
                    todo.append(target)
        assert "mmgen.decoding.speculative" not in seen, start
    assert "mmgen.kernels.step" in graph["mmgen.decoding.speculative"]  # the other direction, lazily


def test_importing_the_kernels_loads_no_decoding_module():
    """In a fresh process: `import mmgen.kernels` (the dispatch) loads neither the loop nor any
    other decoding module; mmgen's re-exported decoding names load on first use."""
    import subprocess
    import sys

    code = ("import sys, mmgen.kernels; loaded = [m for m in sys.modules if m.startswith('mmgen.decoding')]; "
            "assert not loaded, loaded; from mmgen import Autoregressive; assert 'mmgen.decoding.speculative' in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement of `path` names (lazy ones included), absolute only."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_package_imports_no_recipe_and_no_lab_code_and_recipes_no_lab_code():
    """Training recipes import the package, never the other way round; `benchmarks/` (the lab)
    is imported by nothing installed and by no recipe; nothing imports the tests."""
    found = []
    for name, path in modules().items():
        found += [f"{path.relative_to(ROOT)}: {m}" for m in imported_modules(path) if m.split(".")[0] in ("training", "benchmarks", "tests")]
    for path in (ROOT / "training").rglob("*.py"):
        found += [f"{path.relative_to(ROOT)}: {m}" for m in imported_modules(path) if m.split(".")[0] in ("benchmarks", "tests")]
    assert not found, found


def runtime_imports(tree: ast.Module) -> list:
    """Every import statement of a module that runs (lazy ones inside functions included), but
    those under `if TYPE_CHECKING:` (annotations only)."""
    found = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            visit(child)

    visit(tree)
    return found


def test_no_import_circle():
    """The package's, the recipes' and the lab's imports (lazy ones too: a function that imports
    a module that imports its own is a circle all the same) form no circle. Importing a
    package's own ancestors (`from mmgen import registry` in `mmgen.loading`) is how a name
    under that package is reached, not a tie back."""
    folders = {**PACKAGES, "training": "training", "benchmarks": "benchmarks"}
    found = {}
    for folder, package in folders.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    graph = {}
    for name, path in found.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                module = ".".join(filter(None, [base, node.module]))
                subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in found]
                edges.update(subs or ([module] if module in found else []))
            else:
                edges.update(a.name for a in node.names if a.name in found)
        graph[name] = {e for e in edges if e != name and not name.startswith(e + ".")}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def circle_from(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (circle := circle_from(nxt, path + [node])):
                return circle
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state:
            assert not (circle := circle_from(start, [])), " -> ".join(circle)
