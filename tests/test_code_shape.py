"""The package stays readable: no class over 200 lines and no function over 80 in hf_dflash/."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hf_dflash"
MAX_LINES = {ast.ClassDef: 200, ast.FunctionDef: 80, ast.AsyncFunctionDef: 80}


def oversized(path: Path, root: Path) -> list[str]:
    """'path:line name (n lines > limit)' for every class or function of the file over its limit."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        limit = MAX_LINES.get(type(node))
        if limit is not None and (length := node.end_lineno - node.lineno + 1) > limit:
            found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({length} lines > {limit})")
    return found


def test_no_class_over_200_lines_and_no_function_over_80():
    found = [entry for path in sorted(PACKAGE.rglob("*.py")) for entry in oversized(path, PACKAGE.parent)]
    assert not found, "split these into smaller pieces:\n" + "\n".join(found)


def test_the_check_sees_an_oversized_function_and_class(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n\n\nclass Short:\n    pass\n", encoding="utf-8")
    assert oversized(tmp_path / "long.py", tmp_path) == ["long.py:1 long (81 lines > 80)"]
    methods = "\n".join(f"    def m{i}(self):\n        return {i}\n" for i in range(67))
    (tmp_path / "big.py").write_text(f"class Big:\n{methods}", encoding="utf-8")
    assert oversized(tmp_path / "big.py", tmp_path) == ["big.py:1 Big (201 lines > 200)"]
