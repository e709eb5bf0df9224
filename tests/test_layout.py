"""The package's shape: imports go down the layers, no cycles, no private names.

Every `import` in `mlx_kvq` (at module level or inside a function) is read
from the source. A module may import only modules of its own layer or a
lower one: the README's module table, read from README.md, top to bottom
(every shipped module must be in it); the import graph has
no cycle; no module imports another module's `_private` name; mlx-lm's
private names are imported in `mlx_lm_internals.py` only; every shipped
module imports after a plain install (no test-only dependency).
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mlx_kvq

PACKAGE = Path(mlx_kvq.__file__).parent

README = PACKAGE.parent / "README.md"
_NAMED = re.compile(r"`([\w./]+(?:\.py|/))`")  # a file or folder the table names


def readme_table() -> list[tuple[list[str], str]]:
    """The module table under the README's "How it works", top to bottom:
    (what the first column names, the whole row's text) per row."""
    section = README.read_text().split("## How it works", 1)[1]
    rows, started = [], False
    for line in section.splitlines():
        if line.startswith("| `"):
            started = True
            first, rest = line.strip().strip("|").split("|", 1)
            rows.append((_NAMED.findall(first), first + rest))
        elif started and not line.startswith("|"):
            break
    assert len(rows) > 5, f"no module table under 'How it works' in {README}"
    return rows


def dotted(path: str) -> str:
    """`caches/full.py` -> "caches.full"; `caches/` -> "caches"; `__init__.py` -> ""."""
    name = path.rstrip("/").removesuffix(".py").replace("/", ".")
    return "" if name == "__init__" else name


def readme_layers() -> list[tuple[str, list[str]]]:
    """Lowest first: (row, modules it places). A row places what its first
    column names, and any module named by a path (`distributed/coordinator.py`)
    anywhere in it, which places that module there rather than with its folder."""
    out = []
    for first, text in readme_table():
        paths = first + [n for n in _NAMED.findall(text) if "/" in n.rstrip("/")]
        out.append((", ".join(first), [dotted(p) for p in dict.fromkeys(paths)]))
    return out


LAYERS = readme_layers()


def modules() -> dict[str, Path]:
    """Dotted name (relative to mlx_kvq, '' for the package) -> source file."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = modules()


def layer(name: str) -> int:
    """The layer of a module: the README row that places it or, longest
    first, a folder above it."""
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or (p and name.startswith(p + "."))) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"mlx_kvq/{name or '__init__'} is not in the README's module table"
    return rank


def resolve(module: str, node: ast.ImportFrom | ast.Import) -> list[tuple[str, list[str]]]:
    """(imported mlx_kvq module, names taken from it) for one import statement."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name == "mlx_kvq" or alias.name.startswith("mlx_kvq."):
                found.append((alias.name.removeprefix("mlx_kvq").lstrip("."), []))
        return found
    if node.level:
        base = package.split(".") if package else []
        base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
        target = ".".join([*base, *(node.module.split(".") if node.module else [])])
    elif node.module and (node.module == "mlx_kvq" or node.module.startswith("mlx_kvq.")):
        target = node.module.removeprefix("mlx_kvq").lstrip(".")
    else:
        return []
    names = [a.name for a in node.names]
    submodules = [n for n in names if f"{target}.{n}".lstrip(".") in MODULES]
    found += [(f"{target}.{n}".lstrip("."), []) for n in submodules]
    rest = [n for n in names if n not in submodules]
    if rest or not submodules:
        found.append((target, rest))
    return found


def imports() -> dict[str, list[tuple[str, list[str], int]]]:
    """module -> [(imported module, names, line)]."""
    graph = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        graph[name] = [
            (target, names, node.lineno)
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for target, names in resolve(name, node)
        ]
    return graph


GRAPH = imports()


def test_imports_only_go_down_the_layers():
    bad = [
        f"mlx_kvq.{m}:{line} ({LAYERS[layer(m)][0]}) imports mlx_kvq.{t} ({LAYERS[layer(t)][0]})"
        for m, edges in GRAPH.items()
        for t, _, line in edges
        if t in MODULES and layer(t) > layer(m)
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    edges = {m: {t for t, _, _ in e if t in MODULES and t != m} for m, e in GRAPH.items()}
    # A package's __init__ importing its own submodules is how packages re-export.
    for m in edges:
        edges[m] = {t for t in edges[m] if not (t.startswith(m + ".") if m else True)}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_private_names_cross_modules():
    bad = [
        f"mlx_kvq.{m}:{line} imports {n} from mlx_kvq.{t}"
        for m, edges in GRAPH.items()
        for t, names, line in edges
        for n in names
        if n.startswith("_") and t != m
    ]
    for name, path in MODULES.items():
        if name == "mlx_lm_internals":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlx_lm"):
                bad += [
                    f"mlx_kvq.{name}:{node.lineno} imports mlx-lm's private {a.name}"
                    for a in node.names
                    if a.name.startswith("_")
                ]
    assert not bad, "\n".join(bad)


def extra_only_imports() -> set[str]:
    """Import names of what the `test` extra installs beyond a plain install."""
    from importlib.metadata import packages_distributions, requires

    from packaging.requirements import Requirement

    def needs(dist: str, extra: str = "") -> set[str]:
        out = set()
        for text in requires(dist) or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                out.add(req.name.lower().replace("_", "-"))
        return out

    base, todo = set(), list(needs("mlx-kvq"))
    while todo:
        dist = todo.pop()
        if dist not in base:
            base.add(dist)
            # Markers are evaluated for this platform, so every dist reached here
            # is one a plain install brings: one that is missing is a broken
            # environment (PackageNotFoundError), never a reason to skip its
            # dependencies (they would then count as test-only).
            todo += needs(dist)
    extra = needs("mlx-kvq", "test") - needs("mlx-kvq") - base
    return {
        module
        for module, dists in packages_distributions().items()
        if {d.lower().replace("_", "-") for d in dists} & extra
    }


def test_a_missing_dependency_fails_the_extra_check(monkeypatch):
    """A dependency of a plain install that cannot be found is an error, not a
    dist whose own dependencies quietly stop counting as plain-install ones."""
    import importlib.metadata as metadata

    from packaging.requirements import Requirement

    real = metadata.requires
    missing = next(
        req.name
        for req in map(Requirement, real("mlx-kvq"))
        if req.marker is None or req.marker.evaluate({"extra": ""})
    )

    def requires(dist: str):
        if dist.lower() == missing.lower():
            raise metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(metadata, "requires", requires)
    with pytest.raises(metadata.PackageNotFoundError):
        extra_only_imports()


def test_every_shipped_module_imports_without_the_test_extra():
    """No shipped module needs what only the test extra installs (nor the test helpers)."""
    blocked = sorted(extra_only_imports() | {"kvq_testing"})
    assert "openai" in blocked and "mlx" not in blocked
    names = [f"mlx_kvq.{m}" for m in MODULES if m and not m.endswith("__main__")]
    code = (
        "import importlib, sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {blocked!r}:\n"
        "            raise ImportError(f'{name} is only installed with the test extra')\n"
        "sys.meta_path.insert(0, Block())\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_readme_table_places_every_module():
    """Every shipped module is in the README's table, which is read here."""
    compiled = {p.name.split(".")[0] for p in PACKAGE.rglob("*.so")}  # native kernels
    on_disk = {m.name for m in pkgutil.walk_packages([str(PACKAGE)], "")} - compiled
    assert on_disk <= set(MODULES) | {""}
    missing = []
    for m in MODULES:
        try:
            layer(m)
        except AssertionError as e:
            missing.append(str(e))
    assert not missing, "\n".join(missing)
    assert importlib.import_module("mlx_kvq.commands").main
    rows = [row for row, _ in LAYERS]
    assert rows[0].startswith("`config.py`") or "config.py" in rows[0], rows
    assert layer("caches.deepseek_v41") == layer("caches.indexer") == layer("caches.full")
    assert layer("distributed.coordinator") == layer("engine") > layer("distributed.group")


def test_every_file_the_readme_table_names_exists():
    """A name in a row is a module or folder there: at the top of the package,
    inside one of the row's folders, or a path from the package."""
    stale = []
    for first, text in readme_table():
        folders = [PACKAGE / p for p in first if p.endswith("/")]
        for name in _NAMED.findall(text):
            places = [PACKAGE / name] + (
                [] if "/" in name.rstrip("/") else [f / name for f in folders]
            )
            if not any(p.exists() for p in places):
                stale.append(f"{name} (row {', '.join(first)})")
    assert not stale, "the README's module table names what does not exist: " + ", ".join(stale)


def test_no_comment_cites_a_principle_or_an_issue_by_number():
    """Such references point at documents outside the repository: the code
    says the reason itself."""
    pattern = re.compile(r"principle [0-9]|issue [0-9]", re.IGNORECASE)
    root = PACKAGE.parent
    found = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for folder in ("mlx_kvq", "tests", "scripts", "docs")
        for path in sorted((root / folder).rglob("*"))
        if path.suffix in (".py", ".md") and path.is_file()
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, "\n".join(found)


# A number assigned in one module with a comment pointing at where the number
# really lives (another module's name, a `Class.attribute`, "mirrors", "same
# as") is a second copy kept in step by hand.
_NUMBER = re.compile(
    r"^\s*\w+\s*(?::[^=]+)?=\s*-?\d[\d_.]*(?:\s*[*/+-]\s*\d[\d_.]*)*\s*#(?P<c>.*)$"
)
_POINTS_ELSEWHERE = re.compile(r"mirror|same as|restate|\b[A-Z]\w*\.\w+\b|\b[a-z_]+\.py\b")


def test_no_number_is_restated_from_another_module():
    """One truth per number: a module that needs another's number imports it."""
    restated = [
        f"mlx_kvq/{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if (m := _NUMBER.match(line)) and _POINTS_ELSEWHERE.search(m.group("c"))
    ]
    assert not restated, "\n".join(restated)


def test_the_engine_is_its_thread_and_step_loop():
    """`Engine` drives its parts (built in engine/build.py); it does not grow
    into them: under 300 lines."""
    tree = ast.parse((PACKAGE / "engine" / "engine.py").read_text())
    (engine,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine"]
    assert engine.end_lineno - engine.lineno < 300
