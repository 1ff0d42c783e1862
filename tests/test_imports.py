"""The packages' imports point one way, kernels and topology -> ep_runtime -> launch: kernels and
topology know nothing of the runtime or the launchers, the runtime nothing of the launchers (the
CLI, which starts processes, lives in ``launch``; benchmarks that start processes are handed the
launchers); no module imports itself back through others, and no kernel family another that
imports it back (imports inside functions count: they hide a cycle, they do not break it); no
tracked source file is over 600 lines."""

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "topology", "ep_runtime", "launch")
LOWER = {"kernels": set(), "topology": set(), "ep_runtime": {"kernels", "topology"},
         "launch": {"kernels", "topology", "ep_runtime"}}  # the packages each may import (besides itself)
MAX_LINES = 600
KNOWN_LONG: set[str] = set()  # files allowed past MAX_LINES: none


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_module_imports_itself_back():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_kernel_families_do_not_import_each_other_back():
    family = {m: ".".join(m.split(".")[:2]) for m in _modules() if m.startswith("kernels.")}
    graph: dict[str, set[str]] = {}
    for a, targets in _graph().items():
        for b in targets:
            if a in family and b in family and family[a] != family[b]:
                graph.setdefault(family[a], set()).add(family[b])
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_packages_import_one_way():
    wrong = []
    for a, targets in _graph().items():
        for b in targets:
            pa, pb = a.split(".")[0], b.split(".")[0]
            if pa != pb and pb not in LOWER[pa]:
                wrong.append(f"{a} imports {b}")
    assert not wrong, wrong


def test_no_source_file_over_600_lines():
    try:
        tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    long = {f: n for f in tracked.stdout.split() if (n := len((ROOT / f).read_text().splitlines())) > MAX_LINES}
    assert set(long) == KNOWN_LONG, long
