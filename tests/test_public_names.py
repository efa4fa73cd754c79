"""Public names change only with a deprecation.

The public names are every name in the `__all__` of `hf_dflash`, of its top-level modules (`hf_dflash/x.py`) and
of its top-level packages (`hf_dflash/x/__init__.py`), and every name the README's and docs' Python snippets
import; modules deeper down (`hf_dflash.generation.verifying.target_forward`) are the package's own workings.
`tests/public_names.txt` records them, one `module name` a line (`module` alone: a snippet's `import module`).
A name that was renamed or moved keeps its line, marked `-> new.module (removed in X.Y.Z)`, and its old module
re-exports it with a FutureWarning until that release (as `hf_dflash/models.py` does for `hf_dflash.targets`).
"""

import ast
import importlib
import re
import warnings
from pathlib import Path

import pytest

import hf_dflash

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hf_dflash"
RECORD = Path(__file__).resolve().parent / "public_names.txt"
LINE = re.compile(r"^(?P<module>[\w.]+)(?: (?P<name>\w+))?(?: -> (?P<new>[\w.]+) \(removed in (?P<removal>[\d.]+)\))?$")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_names(path: Path) -> list[str]:
    """The names of the file's module-level `__all__` (a literal list or tuple of strings), [] without one."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return [ast.literal_eval(element) for element in node.value.elts]
    return []


def snippet_imports(text: str) -> set[tuple[str, str]]:
    """(module, name) of each `from hf_dflash... import name` and (module, "") of each `import hf_dflash...` in
    the text's ```python snippets (statements that do not parse on their own are skipped)."""
    found = set()
    for block in re.findall(r"```(?:python|py)\n(.*?)```", text, flags=re.S):
        try:
            statements = ast.parse(block).body
        except SyntaxError:
            statements = []
            joined = re.sub(r"import \(([^)]*)\)", lambda m: "import " + " ".join(m[1].split()).rstrip(","), block)
            for line in joined.splitlines():
                try:
                    statements += ast.parse(line.strip()).body
                except SyntaxError:
                    continue
        for node in statements:
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hf_dflash":
                found.update((node.module, alias.name) for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update((a.name, "") for a in node.names if a.name.split(".")[0] == "hf_dflash")
    return found


def public_names() -> set[tuple[str, str]]:
    top_level = [*PACKAGE.glob("*.py"), *PACKAGE.glob("*/__init__.py")]
    names = {(module_name(path), name) for path in top_level for name in all_names(path)}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        names |= snippet_imports(page.read_text(encoding="utf-8"))
    return names


def recorded() -> dict[tuple[str, str], re.Match]:
    entries = {}
    for number, line in enumerate(RECORD.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip() and not line.startswith("#"):
            match = LINE.match(line)
            assert match, f"{RECORD.name}:{number}: {line!r} is not 'module name [-> new.module (removed in X.Y.Z)]'"
            entries[(match["module"], match["name"] or "")] = match
    return entries


def resolve(module: str, name: str):
    """The object `from module import name` gives (the module itself for name "")."""
    imported = importlib.import_module(module)
    return getattr(imported, name) if name else imported


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_every_public_name_is_recorded():
    missing = sorted(public_names() - set(recorded()))
    assert not missing, f"new public names: add these lines to tests/{RECORD.name}:\n" + "\n".join(
        f"{module} {name}".rstrip() for module, name in missing
    )


@pytest.mark.parametrize("module,name", sorted(recorded()), ids=lambda value: value)
def test_a_recorded_name_still_resolves(module, name):
    """A recorded name imports without a warning, or, marked renamed, with a FutureWarning naming its new
    module, and is the new module's object."""
    entry = recorded()[(module, name)]
    if entry["new"] is None:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            try:
                resolve(module, name)
            except (ImportError, AttributeError) as error:
                pytest.fail(
                    f"public name {module}.{name} disappeared ({error}): keep re-exporting it from {module} with a "
                    f"FutureWarning for one release (see hf_dflash/models.py) and mark its line in {RECORD.name}"
                )
        return
    if version(hf_dflash.__version__) >= version(entry["removal"]):
        pytest.skip(f"{module}.{name} may be removed from {entry['removal']} on: drop its shim and its line")
    with pytest.warns(FutureWarning, match=re.escape(entry["new"])):
        old = resolve(module, name)
    assert old is resolve(entry["new"], name)


def test_the_docs_import_no_deprecated_name():
    deprecated = {key for key, entry in recorded().items() if entry["new"] is not None}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        used = snippet_imports(page.read_text(encoding="utf-8")) & deprecated
        assert not used, f"{page.name} imports deprecated names: {sorted(used)}"


def test_the_old_models_module_warns_and_gives_the_targets_names():
    with pytest.warns(FutureWarning, match="hf_dflash.targets"):
        from hf_dflash.models import load_target
    from hf_dflash.targets import load_target as new

    assert load_target is new
    with pytest.raises(AttributeError, match="no_such_name"):
        resolve("hf_dflash.models", "no_such_name")


def test_the_checks_see_snippet_imports_and_a_vanished_name(tmp_path):
    text = "```python\nfrom hf_dflash.x import (\n    a,\n    b as c,\n)\nimport hf_dflash.y\nprint(\n```\n"
    assert snippet_imports(text) == {("hf_dflash.x", "a"), ("hf_dflash.x", "b"), ("hf_dflash.y", "")}
    (tmp_path / "m.py").write_text('__all__ = ["f", "g"]\n', encoding="utf-8")
    assert all_names(tmp_path / "m.py") == ["f", "g"]
    with pytest.raises(AttributeError):
        resolve("hf_dflash", "no_such_public_name")
