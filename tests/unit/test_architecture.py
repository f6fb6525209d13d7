"""The folders are the architecture (docs/DESIGN.md, "Layout"): read from the source, not run.

Imports are read with `ast`, those inside functions included (a lazy import is still a dependency);
imports under `if TYPE_CHECKING:` are left out (they never run).
"""

import ast
from collections import defaultdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# import name -> folder: the kernels' folder is kernels/, their import name locoswarm_kernels
# (pyproject.toml says why).
PACKAGES = {
    "locoswarm_kernels": "kernels",
    "protocol": "protocol",
    "node": "node",
    "coordinator": "coordinator",
    "locoswarm": "locoswarm",
    "tools": "tools",
    "deploy": "deploy",
}


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            parts = (package, *path.relative_to(REPO_ROOT / folder).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(tree: ast.AST) -> set[str]:
    """Every absolute module name `tree` imports, as written (`from a.b import c` gives a.b and a.b.c)."""
    names: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        stack.extend(ast.iter_child_nodes(node))
    return names


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for imported in _imported(ast.parse(path.read_text(), str(path))):
            if imported in modules and imported != name:
                graph[name].add(imported)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_module_imports_itself_back():
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_layers_point_one_way():
    """kernels <- protocol <- node and coordinator; the runtime never imports tools; the
    coordinator never imports torch; `kernels` (Hugging Face's) is never ours."""
    modules = _modules()
    for name, path in modules.items():
        imported = _imported(ast.parse(path.read_text(), str(path)))
        top = {module.split(".")[0] for module in imported}
        layer = name.split(".")[0]
        if layer == "locoswarm_kernels":
            assert not top & {"protocol", "node", "coordinator", "tools", "locoswarm", "kernels"}, name
        if layer == "protocol":
            assert not top & {"node", "coordinator", "tools", "locoswarm"}, name
        if layer in ("node", "coordinator", "protocol", "locoswarm_kernels"):
            assert "kernels" not in top, name  # Hugging Face's package, not ours
            assert not top & {"tools", "tests"}, name
        if layer == "coordinator":
            assert "torch" not in top and "node" not in top, name


def test_every_package_is_installed():
    """pyproject.toml lists the packages by hand (the kernels' import name is mapped): a package
    folder left off the list would be missing from the wheel, and an editable install hides that."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    listed = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {name for name, path in _modules().items() if path.name == "__init__.py"} | {"locoswarm_kernels"}
    assert listed == on_disk
    assert not (REPO_ROOT / "kernels" / "__init__.py").exists()  # else it shadows Hugging Face's `kernels`
