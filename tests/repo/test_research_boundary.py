"""research/ sits beside the product: nothing in modeling_bst/, training/ or the README imports it, and the wheel
does not ship it (setup.cfg's packages)."""

import ast
import configparser
import re
from pathlib import Path

import setuptools


ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("modeling_bst", "training")


def _imports_of(tree: ast.AST) -> list[str]:
    """Modules a tree imports: import statements, importlib.import_module / __import__ calls with a constant name,
    and ``-m MODULE`` in a list of constants (a subprocess command)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names.append(node.args[0].value)
        elif isinstance(node, ast.List | ast.Tuple):
            items = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            names += [b for a, b in zip(items, items[1:]) if a == "-m"]
    return names


def _is_research(module: str) -> bool:
    return module == "research" or module.startswith("research.")


def test_the_checker_sees_every_kind_of_import():
    code = "import research.mqar\nfrom research import lm_long\nimportlib.import_module('research.common')\n"
    code += "subprocess.run([sys.executable, '-m', 'research.mqar'])\nfrom training import optim\n"
    assert [m for m in _imports_of(ast.parse(code)) if _is_research(m)] == [
        "research.mqar",
        "research",
        "research.common",
        "research.mqar",
    ]


def test_the_product_packages_do_not_import_research():
    files = [p for package in PRODUCT for p in sorted((ROOT / package).rglob("*.py"))]
    assert len(files) > 10
    offending = {
        str(p.relative_to(ROOT)): bad
        for p in files
        if (bad := [m for m in _imports_of(ast.parse(p.read_text(), str(p))) if _is_research(m)])
    }
    assert not offending, f"modeling_bst/ and training/ must not import research/: {offending}"


def test_the_readme_does_not_use_research():
    text = (ROOT / "README.md").read_text()
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        assert not [m for m in _imports_of(ast.parse(block)) if _is_research(m)]
    assert not re.search(r"(^|\s)(from|import)\s+research\b|-m\s+research\.", text, flags=re.M)


def test_the_wheel_does_not_ship_research():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    find = cfg["options.packages.find"]
    include = find.get("include", "*").split()
    exclude = find.get("exclude", "").split()
    packages = setuptools.find_packages(str(ROOT), include=include, exclude=exclude)
    assert "modeling_bst" in packages and "training" in packages and "training.tasks" in packages
    assert not [p for p in packages if _is_research(p)]
    assert "research*" in exclude


def _research_imports(path: Path) -> set[str]:
    """The top-level modules and ``research.*`` modules that a research file imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            if node.module == "research":
                names |= {f"research.{a.name}" for a in node.names}
    return names


def test_research_imports_no_benchmark_and_has_no_import_cycle():
    """The helpers research/ shares with benchmarks/ live in ``reporting`` (neither imports the other), and research's
    modules import each other without a cycle (the plots import the experiments, which import ``research.style``)."""
    files = {f"research.{p.stem}": p for p in sorted((ROOT / "research").glob("*.py")) if p.stem != "__init__"}
    imports = {name: _research_imports(path) for name, path in files.items()}
    benchmarks = {name: sorted(m for m in found if m.split(".")[0] == "benchmarks") for name, found in imports.items()}
    assert not {name: found for name, found in benchmarks.items() if found}
    graph = {name: sorted(m for m in found if m in files) for name, found in imports.items()}
    assert set(graph["research.plots"]) >= {"research.lm_long", "research.lm_quality", "research.mqar"}
    done, path = set(), []

    def visit(name):
        assert name not in path, f"import cycle: {' -> '.join([*path[path.index(name) :], name])}"
        if name in done:
            return
        path.append(name)
        for other in graph[name]:
            visit(other)
        path.pop()
        done.add(name)

    for name in graph:
        visit(name)
