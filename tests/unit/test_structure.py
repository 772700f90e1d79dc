"""The codebase's shape: no import cycles (function-level and type-only imports included),
small modules and functions, and a CLI that answers --help without importing torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "kvtier"
BENCH = ROOT / "bench"
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 60
# The packages, lowest layer first: a module imports only its own package and the ones before it
# (docs/architecture.md, "Module map"). `kvtier.testing` comes last: nothing imports it.
LAYERS = ["common", "layout", "memory", "transport", "storage", "hosted", "worker", "engine"]
LAYERS += ["vllm", "lmcache", "sglang", "ops"]
LAYERS += ["testing"]
ANYWHERE = {"kvtier", "kvtier.errors"}  # the lazy root and the exception tree


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in SRC.rglob("*.py")}


def _imports(path: Path, known: set[str]) -> set[str]:
    """Every kvtier module ``path`` imports, wherever the import statement is."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known}
    return found


def test_no_import_cycles_anywhere() -> None:
    modules = _modules()
    graph = {name: _imports(path, set(modules)) - {name} for name, path in modules.items()}
    # The package itself re-exports names lazily; a submodule importing `kvtier` is fine.
    for deps in graph.values():
        deps.discard("kvtier")
    cycles = []

    def visit(node: str, stack: list[str], seen: set[str]) -> None:
        for dep in sorted(graph[node]):
            if dep in stack:
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in seen:
                seen.add(dep)
                visit(dep, stack + [dep], seen)

    for name in graph:
        visit(name, [name], {name})
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


def _layer(module: str) -> int:
    package = module.split(".")[1]
    assert package in LAYERS, f"{module}: not in a layer's package (add it to LAYERS and the map)"
    return LAYERS.index(package)


def test_packages_import_only_lower_layers() -> None:
    """Every module but the root and the exception tree lives in a layer's package, and imports
    only its own package and lower layers (function-level and type-only imports included)."""
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        if name in ANYWHERE:
            continue
        for dep in _imports(path, set(modules)) - ANYWHERE:
            if _layer(dep) > _layer(name):
                wrong.append(f"{name} imports {dep}")
    assert wrong == [], wrong


HEAVY = {"torch", "numpy", "zmq", "msgspec", "vllm", "mooncake", "yaml", "prometheus_client"}


def _loaded_on_import(path: Path, known: set[str]) -> set[str]:
    """What importing ``path`` imports: module-level statements, TYPE_CHECKING blocks excepted
    (kvtier modules by name, anything else by its top package)."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.update(_named(node, known))
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []) if not _is_function(node) else []:
                    visit(getattr(child, "body", [child]) if field == "handlers" else [child])

    visit(ast.parse(path.read_text()).body)
    return found


def _is_function(node: ast.AST) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))


def _named(node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif node.level == 0 and node.module:
        names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    else:
        return set()
    out = set()
    for name in names:
        parts = name.split(".")
        kvtier = {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & known
        out |= kvtier if name.startswith("kvtier.") else {parts[0]}
    return out


def test_function_level_imports_avoid_a_heavy_import_or_say_why() -> None:
    """An import inside a function is there to keep torch, ZeroMQ, vLLM, ... out of a process
    that does not need them (``kvtier --help``, ``kvtier status``): it must spare its module a
    heavy import that the module's own imports do not already make, or carry a ``# local:``
    comment on the line before it saying why it is local."""
    modules = _modules()
    known = set(modules)
    direct = {name: _loaded_on_import(path, known) for name, path in modules.items()}

    def closure(name: str, seen: set[str]) -> set[str]:
        if name in seen:
            return set()
        seen.add(name)
        found = {name}
        for dep in direct.get(name, ()):
            found |= closure(dep, seen)
        return found

    def heavy(names: set[str]) -> set[str]:
        return {m for n in names for m in closure(n, set()) if m in HEAVY}

    unexplained = []
    for name, path in modules.items():
        lines = path.read_text().splitlines()
        made = heavy(direct[name])
        functions = [n for n in ast.walk(ast.parse(path.read_text())) if _is_function(n)]
        for function in functions:
            for node in ast.walk(function):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                if heavy(_named(node, known)) - made:
                    continue
                if lines[node.lineno - 2].strip().startswith("# local:"):
                    continue
                unexplained.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert sorted(set(unexplained)) == [], sorted(set(unexplained))


def test_modules_classes_and_functions_are_small() -> None:
    """Modules <= 400 lines, classes <= 300, functions <= 60: the library and the benchmarks."""
    too_long = []
    files = {**_modules(), **{f"kvtier_bench.{p.stem}": p for p in BENCH.glob("*.py")}}
    for name, path in files.items():
        lines = path.read_text().splitlines()
        if len(lines) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {len(lines)} lines")
        for node in ast.walk(ast.parse(path.read_text())):
            length = (getattr(node, "end_lineno", 0) or 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and length > MAX_CLASS_LINES:
                too_long.append(f"class {name}.{node.name}: {length} lines")
            function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if function and length > MAX_FUNCTION_LINES:
                too_long.append(f"{name}.{node.name}: {length} lines")
    assert not too_long, too_long


def test_help_answers_without_importing_torch() -> None:
    code = (
        "import sys; from kvtier.ops.cli import build_parser; build_parser(); "
        "import kvtier; kvtier.KvtierError; "
        "print(sorted(m for m in ('torch', 'zmq', 'vllm', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_operator_tools_answer_without_importing_torch(tmp_path) -> None:
    """`kvtier store` and `kvtier status` are what an operator types on a busy server: they load
    neither torch nor a backend (0.4 s instead of 3 s here)."""
    code = (
        "import sys; from kvtier.ops.cli import main\n"
        "for argv in (['store', 'stats', sys.argv[1]], ['status', 'no-such-instance']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "print('loaded:', sorted(m for m in ('torch', 'vllm', 'mooncake') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip().splitlines()[-1] == "loaded: []", out.stdout + out.stderr


def test_the_architecture_map_names_every_module() -> None:
    """docs/architecture.md's module map: every module of src/kvtier, with its one job."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    named = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
    modules = {
        str(p.relative_to(SRC).with_suffix("")) for p in SRC.rglob("*.py") if p.name != "py.typed"
    }
    assert modules - named == set(), f"not on the map: {sorted(modules - named)}"
    assert named - modules == set(), f"on the map but gone: {sorted(named - modules)}"


def test_the_storage_contract_is_written_where_readers_look() -> None:
    """Every abstract method of StorageBackend says what it must do; a new backend that does
    not state its capabilities cannot be built."""
    import inspect

    import pytest

    from kvtier.storage.base import StorageBackend

    undocumented = [
        name
        for name in StorageBackend.__abstractmethods__
        if not inspect.getdoc(getattr(StorageBackend, name))
    ]
    assert undocumented == []
    capabilities = {"exposes_registered_memory", "persistent"}
    assert capabilities <= StorageBackend.__abstractmethods__

    class Silent(StorageBackend):  # implements the data contract, states no capability
        kind = "silent"
        exists_prefix = read = put_from = delete = usage = None  # type: ignore[assignment]
        read_object = write_object = found_corrupt = None  # type: ignore[assignment]
        report_corrupt = watch_removals = None  # type: ignore[assignment]

    with pytest.raises(TypeError, match="persistent"):
        Silent()


def test_the_docs_name_only_what_exists() -> None:
    """docs/seed-behaviours.md named a module that had been deleted: every test it cites and
    every kvtier name it quotes must exist."""
    import re

    text = (ROOT / "docs" / "seed-behaviours.md").read_text()
    missing = []
    for module, name in re.findall(r"(test_\w+)::(\w+)", text):
        paths = list((ROOT / "tests").rglob(f"{module}.py"))
        if not paths or f"def {name}(" not in paths[0].read_text():
            missing.append(f"{module}::{name}")
    sources = "\n".join(p.read_text() for p in SRC.rglob("*.py"))
    for dotted in re.findall(r"`kvtier\.([\w.]+)", text):
        if dotted.rsplit(".", 1)[-1] not in sources:
            missing.append(dotted)
    assert missing == []


STORAGE_FACES = {"kvtier.storage", "kvtier.storage.base", "kvtier.storage.config"}


def test_outside_storage_only_its_faces_are_imported() -> None:
    """Code outside ``kvtier.storage`` imports only ``kvtier.storage``, its ``base`` and its
    ``config``: a backend's folder is its own to reshape (docs/architecture.md, "storage")."""
    modules = _modules()
    reaching = []
    for name, path in modules.items():
        if name == "kvtier.storage" or name.startswith("kvtier.storage."):
            continue
        for dep in _imports(path, set(modules)):
            if dep.startswith("kvtier.storage.") and dep not in STORAGE_FACES:
                reaching.append(f"{name} imports {dep}")
    assert reaching == [], reaching
