"""The package's structure: no import circles between its modules (imports deferred into functions included),
kernel modules read no environment variables, and only the plan module decides which kernel runs."""
import ast
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "sparsemla"


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _graph():
    mods = dict(_modules())
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(m, is_pkg, node)
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                if t in mods and t != m:
                    graph[m].add(t)
    return graph


def _parents(m: str):
    parts = m.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_no_import_circles():
    graph = _graph()
    # importing a module runs its packages' __init__ first: those edges are implied, not circles of ours
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if n in _parents(m) or m in _parents(n):
                continue
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_kernel_modules_read_no_environment():
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        text = path.read_text()
        assert "os.environ" not in text and "getenv" not in text, path


@pytest.mark.parametrize("name", ["few_planned", "FEW_WAVES", "WIDE_MIN_HEADS", "head_block"])
def test_dispatch_policy_lives_in_the_plan(name):
    """The names that decide which kernel runs are defined in sparsemla/plan.py only."""
    hits = [p for p in ROOT.rglob("*.py") if p.name != "plan.py"
            and any(isinstance(n, (ast.FunctionDef, ast.Assign)) and
                    (getattr(n, "name", None) == name or
                     any(getattr(t, "id", None) == name for t in getattr(n, "targets", [])))
                    for n in ast.walk(ast.parse(p.read_text())))]
    assert not hits, hits


def test_builtin_backends_register_from_an_explicit_list():
    text = (ROOT / "backends" / "registry.py").read_text()
    tree = ast.parse(text)
    imported = {_resolve("sparsemla.backends.registry", False, n) for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom)}
    assert not any(m.startswith("sparsemla.backends.") for m in imported), imported
    assert os.path.exists(ROOT / "backends" / "__init__.py")


def test_host_code_does_not_call_triton_cdiv():
    """``triton.cdiv`` is a jit function: called from the host it goes through Triton's launcher (~4 us a call on
    the H200's host), which a launch path pays per call.  Host code divides in Python; kernels use ``tl.cdiv``."""
    hits = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "cdiv"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "triton"):
                hits.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    assert not hits, hits
