"""The package's layers, read from its source: who may import whom, no cycles, private Lightning in one place."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "lightning_gpipe"

#: Each layer may import itself and the layers listed (besides torch and the standard library).
LAYERS = {
    "engine": set(),
    "balancing": {"engine"},
    "checkpointing": {"engine", "_subclass"},
    "monitor.timer": {"engine"},
    "monitor.timeline": {"engine", "monitor.timer"},
    "_subclass": set(),
    "launch": {"engine"},
    "models": {"engine"},
    "_lightning": {"engine", "_subclass", "checkpointing"},
    "stop_together": set(),
    "prediction_writers": set(),
    "metric_sync": set(),
    "sigterm": {"_lightning"},
    "requeue": {"_lightning"},
    "interrupt": {"_lightning"},
    "weight_averages": {"engine", "_lightning"},
    "global_norm_clipping": {"engine"},
    "strategy": {
        "refusals",
        "engine",
        "balancing",
        "checkpointing",
        "_lightning",
        "_subclass",
        "stop_together",
        "prediction_writers",
        "metric_sync",
        "sigterm",
        "requeue",
        "interrupt",
        "weight_averages",
        "global_norm_clipping",
    },
    "monitor.callback": {"engine", "monitor.timer", "monitor.timeline", "_lightning", "strategy"},
    "refusals": {"engine"},
    "tasks": {"models"},
}
#: Layers that must work without Lightning (plain PyTorch).
PLAIN = (
    "engine",
    "balancing",
    "checkpointing",
    "monitor.timer",
    "monitor.timeline",
    "_subclass",
    "global_norm_clipping",
    "launch",
    "models",
)


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name below ``lightning_gpipe`` (``engine.pipe``, ``strategy``...)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The absolute module names ``name`` imports at module level or in functions (``TYPE_CHECKING`` blocks too)."""
    tree = ast.parse(MODULES[name].read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative imports are not used, but resolve them anyway
                package = name.split(".")[: -node.level] if not MODULES[name].name == "__init__.py" else name.split(".")
                base = ".".join(["lightning_gpipe", *package, node.module])
            out.add(base)
            out |= {f"{base}.{alias.name}" for alias in node.names}  # `from pkg import module`
    return out


def _own(imported: set[str]) -> set[str]:
    """The package's modules among ``imported``, without the ``lightning_gpipe.`` prefix."""
    return {m[len("lightning_gpipe.") :] for m in imported if m.startswith("lightning_gpipe.")} & set(MODULES)


def _layer(module: str) -> str:
    for layer in sorted(LAYERS, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    return ""


def test_every_module_belongs_to_a_layer():
    unplaced = [m for m in MODULES if m and m != "cli" and m != "monitor" and not _layer(m)]
    assert not unplaced, f"modules outside the layers of docs/architecture.md: {unplaced}"


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_each_layer_imports_only_the_layers_below_it(layer):
    allowed = LAYERS[layer] | {layer}
    wrong = {
        (module, imported)
        for module in MODULES
        if _layer(module) == layer
        for imported in _own(_imports(module))
        if _layer(imported) not in allowed
    }
    assert not wrong, f"{layer} imports outside {sorted(allowed)}: {sorted(wrong)}"


@pytest.mark.parametrize("layer", PLAIN)
def test_plain_pytorch_layers_import_no_lightning(layer):
    wrong = {
        (module, imported)
        for module in MODULES
        if _layer(module) == layer
        for imported in _imports(module)
        if imported.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric")
    }
    assert not wrong, f"{layer} is plain PyTorch but imports Lightning: {sorted(wrong)}"


def test_the_modules_import_each_other_without_cycles():
    graph = {m: _own(_imports(m)) - {m} for m in MODULES if m}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for nxt in sorted(graph.get(module, ())):
            if nxt.startswith(module + "."):  # a package importing its own modules in __init__
                continue
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_private_lightning_names_are_used_in_one_module_only():
    users = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        private = [
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lightning"
            for alias in node.names
            if alias.name.startswith("_") or any(part.startswith("_") for part in node.module.split("."))
        ]
        if private:
            users[module] = private
    assert set(users) <= {"_lightning"}, f"private Lightning imports outside _lightning.py: {users}"
    assert users, "the check found no private import at all: the test no longer reads the source it should"


def _defined(path: pathlib.Path) -> set[str]:
    """Top-level functions and classes of a file, and ``Class.method`` for their methods."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{item.name}" for item in node.body if isinstance(item, ast.FunctionDef)}
    return names


def test_the_architecture_doc_names_files_and_functions_that_exist():
    import re

    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    references = re.findall(r"`([a-z_/]+\.py)(?:: ([A-Za-z_.]+))?`", doc)
    assert len(references) > 40, "the doc walks the step through the files"
    files = {p.relative_to(PACKAGE).as_posix(): p for p in PACKAGE.rglob("*.py")}
    missing = []
    for file, name in references:
        matches = [p for rel, p in files.items() if rel == file or rel.endswith("/" + file)]
        if not matches:
            missing.append(file)
        elif name and not any(name in _defined(p) for p in matches):
            missing.append(f"{file}: {name}")
    assert not missing, f"docs/architecture.md names what the code does not hold: {missing}"


def test_the_architecture_doc_names_methods_that_exist():
    import re

    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    homes = {
        "GPipeStrategy": "strategy.py",
        "GPipe": "engine/pipe.py",
        "StageRunner": "engine/stage.py",
        "_Bridge": "engine/stage.py",
        "TiedCopies": "engine/tied.py",
        "Channels": "engine/channels.py",
    }
    named = re.findall(r"`(" + "|".join(homes) + r")\.([A-Za-z_]+)", doc)
    assert len(named) > 15
    missing = [f"{cls}.{name}" for cls, name in named if f"{cls}.{name}" not in _defined(PACKAGE / homes[cls])]
    assert not missing, f"docs/architecture.md names methods the code does not have: {missing}"


def test_every_test_the_compatibility_page_names_exists():
    import re

    root = PACKAGE.parent
    page = (root / "docs" / "compatibility.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| ") and "`tests/" in line]
    assert len(rows) >= 40
    missing = []
    for file, name in re.findall(r"`(tests/[a-z_]+\.py)::([a-z0-9_]+)(?:\[[^\]]*\])?`", page):
        path = root / file
        if not path.exists() or name not in _defined(path):
            missing.append(f"{file}::{name}")
    assert not missing, f"docs/compatibility.md names tests that do not exist: {missing}"
