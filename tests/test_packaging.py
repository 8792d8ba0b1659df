"""Packaging: every import the package makes is declared in pyproject.toml (or is the host
package of a module another program loads, ``[tool.tierd.host-modules]``), and
``scripts/setup`` skips an up-to-date venv and runs one at a time.

The clean-install check itself (a fresh venv, ``pip install .``, every module imported, one
``tierd simulate``) takes minutes: it is ``scripts/check_install``, run by CI.
"""

from __future__ import annotations

import ast
import fcntl
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tierd"
SETUP = ROOT / "scripts" / "setup"
# Modules whose module-level imports may come from extras: the conformance suite is for
# tests only (and runs over the GPU store too); the GPU store is the `gpu` extra's, imported
# only for a GPU tier (tests/test_light_install.py checks nothing else loads torch).
TEST_ONLY_MODULES = {
    "tierd/testing/conformance.py": ("test", "gpu"),
    "tierd/stores/gpu.py": ("gpu",),
    "tierd/stores/gpu_calls.py": ("gpu",),
    "tierd/stores/gpu_packing.py": ("gpu",),
}
# Import names whose distribution is not the import name with "_" read as "-".
DISTRIBUTION_OF = {"yaml": "pyyaml", "zmq": "pyzmq"}


@dataclass(frozen=True, slots=True)
class Import:
    module: str  # the top-level name imported
    path: str  # relative to the repository root
    line: int
    eager: bool  # at module level, outside `if TYPE_CHECKING:`


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    found = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if found is None:
        raise ValueError(f"unreadable requirement {requirement!r}")
    return _normalise(found.group(1))


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports_in(body: list[ast.stmt], path: str, eager: bool) -> Iterator[Import]:
    for node in body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(alias.name.split(".")[0], path, node.lineno, eager)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield Import(node.module.split(".")[0], path, node.lineno, eager)
        elif isinstance(node, ast.If) and _is_type_checking(node):
            yield from _imports_in(node.body, path, eager=False)
            yield from _imports_in(node.orelse, path, eager)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for child in ast.walk(node):
                if isinstance(child, ast.Import | ast.ImportFrom):
                    yield from _imports_in([child], path, eager=False)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                block = getattr(node, field, None)
                if isinstance(block, list):
                    yield from _imports_in(block, path, eager)


def third_party_imports() -> list[Import]:
    found = []
    for file in sorted(PACKAGE.rglob("*.py")):
        path = file.relative_to(ROOT).as_posix()
        tree = ast.parse(file.read_text(), filename=path)
        for imp in _imports_in(tree.body, path, eager=True):
            if imp.module not in sys.stdlib_module_names and imp.module not in {
                "tierd",
                "__future__",
            }:
                found.append(imp)
    return found


def host_modules(pyproject: Path) -> dict[str, str]:
    """Modules another program loads, each with the package that program brings."""
    tool = tomllib.loads(pyproject.read_text()).get("tool", {})
    hosts: dict[str, str] = tool.get("tierd", {}).get("host-modules", {})
    return hosts


def declared(pyproject: Path) -> tuple[set[str], dict[str, set[str]]]:
    """The core dependencies and each extra's, as normalised distribution names."""
    project = tomllib.loads(pyproject.read_text())["project"]
    core = {_requirement_name(r) for r in project["dependencies"]}
    extras = {
        extra: {_requirement_name(r) for r in reqs} - {"tierd"}
        for extra, reqs in project.get("optional-dependencies", {}).items()
    }
    return core, extras


def undeclared_imports(pyproject: Path) -> list[str]:
    """Every import of tierd/ that pyproject.toml does not cover, one line each."""
    core, extras = declared(pyproject)
    hosts = host_modules(pyproject)
    problems = []
    for imp in third_party_imports():
        module = imp.path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        if hosts.get(module) == imp.module:
            continue  # the program that loads the module brings this package
        dist = _normalise(DISTRIBUTION_OF.get(imp.module, imp.module))
        where = f"{imp.path}:{imp.line}: {imp.module} (distribution {dist})"
        allowed = set(core)
        if not imp.eager:
            allowed = allowed.union(*extras.values())
        elif imp.path in TEST_ONLY_MODULES:
            allowed = allowed.union(*(extras[extra] for extra in TEST_ONLY_MODULES[imp.path]))
        if dist not in allowed:
            kind = "imported at module level" if imp.eager else "imported"
            problems.append(f"{where} is {kind} but not a dependency that covers it")
    return problems


def test_every_import_of_the_package_is_declared() -> None:
    assert undeclared_imports(ROOT / "pyproject.toml") == []


def test_the_import_audit_sees_an_undeclared_import(tmp_path: Path) -> None:
    # pyproject.toml without numpy, as it was when a clean install could not simulate.
    text = (ROOT / "pyproject.toml").read_text()
    without = re.sub(r'^\s*"numpy[^"]*",\n', "", text, flags=re.MULTILINE)
    assert without != text
    (tmp_path / "pyproject.toml").write_text(without)
    problems = undeclared_imports(tmp_path / "pyproject.toml")
    assert any("tierd/stores/disk/io.py" in p and ": numpy " in p for p in problems), problems


def test_host_modules_are_modules_of_the_package() -> None:
    for module in host_modules(ROOT / "pyproject.toml"):
        path = ROOT / (module.replace(".", "/") + ".py")
        assert path.is_file(), f"[tool.tierd.host-modules] names {module}, which is not a module"


def test_the_import_audit_sorts_eager_and_lazy_imports() -> None:
    imports = {(i.path, i.module): i.eager for i in third_party_imports()}
    assert imports[("tierd/stores/disk/io.py", "numpy")] is True
    # matplotlib (the plots extra) is imported only inside functions and for type checks.
    assert imports[("tierd/workload/plots.py", "matplotlib")] is False


# ---- scripts/setup ------------------------------------------------------------------


@pytest.fixture
def venv() -> Path:
    """The venv running these tests, which scripts/setup made (or a skip saying why not)."""
    prefix = Path(sys.prefix)
    # scripts/setup creates its lock file first of all, before the venv itself.
    if prefix == Path(sys.base_prefix) or not (prefix / ".tierd-setup.lock").is_file():
        pytest.skip(f"{prefix} is not a venv made by scripts/setup")
    return prefix


def run_setup(venv: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TIERD_VENV": str(venv)}
    return subprocess.run(
        [str(SETUP)], env=env, capture_output=True, text=True, timeout=600, check=False
    )


def test_setup_skips_an_up_to_date_venv(venv: Path) -> None:
    first = run_setup(venv)  # installs if pyproject.toml changed since the last set-up
    assert first.returncode == 0, first.stderr
    second = run_setup(venv)
    assert second.returncode == 0, second.stderr
    assert f"{venv} is up to date" in second.stderr
    assert "skipped the install" in second.stderr
    assert "installing" not in second.stderr


def test_a_second_setup_waits_for_the_first(venv: Path) -> None:
    assert run_setup(venv).returncode == 0  # up to date from here on
    env = {**os.environ, "TIERD_VENV": str(venv)}
    with open(venv / ".tierd-setup.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as a running setup holds it
        waiting = subprocess.Popen([str(SETUP)], env=env, stderr=subprocess.PIPE, text=True)
        try:
            assert waiting.stderr is not None
            first_line = waiting.stderr.readline()
            assert "another setup is working on" in first_line
            assert waiting.poll() is None  # still waiting while the lock is held
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            _, rest = waiting.communicate(timeout=120)
    assert waiting.returncode == 0, rest
    assert "skipped the install" in rest
