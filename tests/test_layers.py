"""The package's imports point one way: no module imports a higher layer, and no import cycle exists.

Layers, bottom to top (a module may import its own layer and any lower one):

    0  utilities            json_files, packaged_files, dtypes, caches, folder_lock, user_errors, output_paths,
                            packed_linears (CPU linear layers through oneDNN), interrupts (Ctrl-C recorded),
                            machine_load (the machine's load and the thread count timings run at)
    1  models               modeling_dflash, targets (the target registry; `models`, its deprecated alias),
                            target_features
    2  cards                hub_cards (model card, training record, benchmark JSON schemas)
    3  checkpoints          formats, loading, saving, converting, publishing
    4  generation           the decoding loop and what it needs
    5  data, trainer        data preparation and training
    6  bench                benchmarks of generation
    7  entry points         cli, demo, generate_command, recipe (every command's stages), the package __init__

Function-level imports count too: a lazy import is still a dependency.
"""

import ast
from pathlib import Path

import pytest

import hf_dflash

PACKAGE = Path(hf_dflash.__file__).parent
LAYERS = {
    "json_files": 0,
    "packaged_files": 0,
    "dtypes": 0,
    "caches": 0,
    "folder_lock": 0,
    "user_errors": 0,
    "output_paths": 0,
    "packed_linears": 0,
    "interrupts": 0,
    "machine_load": 0,
    "models": 1,  # the deprecated alias of targets (hf_dflash/models.py)
    "modeling_dflash": 1,
    "targets": 1,
    "target_features": 1,
    "hub_cards": 2,
    "checkpoints": 3,
    "generation": 4,
    "data": 5,
    "trainer": 5,
    "bench": 6,
    "cli": 7,
    "demo": 7,
    "generate_command": 7,
    "recipe": 7,
    "__init__": 7,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """hf_dflash modules imported anywhere in the file (relative imports resolved)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found.update(c for c in candidates if c.split(".")[0] == "hf_dflash" and is_module(c))
    found.discard(name)
    return found


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def layer_of(name: str) -> int:
    parts = name.split(".")
    key = parts[1] if len(parts) > 1 else "__init__"
    if key not in LAYERS:
        raise AssertionError(f"{name} is in no layer: add {key!r} to LAYERS in {__file__} (and its docstring).")
    return LAYERS[key]


GRAPH = {module_name(path): imported_modules(path) for path in PACKAGE.rglob("*.py")}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_upward_import(module):
    upward = sorted(target for target in GRAPH[module] if layer_of(target) > layer_of(module))
    assert not upward, f"{module} (layer {layer_of(module)}) imports higher layers: {upward}"


def test_no_import_cycle():
    """Depth-first search over module imports (a package's __init__ re-exporting its modules is not a
    cycle with them: edges into a package's own __init__ from inside it are left out)."""
    graph = {
        module: {t for t in targets if not module.startswith(t + ".")}
        for module, targets in GRAPH.items()
        if module != "hf_dflash"
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_walk_sees_function_level_imports(tmp_path):
    """The checker itself: a lazy import inside a function is found (so it cannot hide an upward import)."""
    tree = ast.parse("def f():\n    from ..bench import loading\n")
    assert any(isinstance(node, ast.ImportFrom) and node.level == 2 for node in ast.walk(tree))
    assert "hf_dflash.bench.loading" in imported_modules(PACKAGE / "generate_command.py")
