"""Training prompts made from real Python code: the modules of pinned pure-Python PyPI packages.

Code is where drafters fall short on prompts the project has never seen (a continuation of a function from its
docstring, a code file pasted with a task), and the other code sources are problem statements (CodeI/O, LeetCode).
Two sources read the modules of `CODE_PACKAGES` (boltons, more-itertools: documented utility code, BSD / MIT):

- `code-functions`: each public function (or method of a public class) with a docstring, its signature and
  docstring given as a task to implement (short prompts; the reply is code).
- `code-files`: a run of a module's consecutive top-level statements, `FILE_CHARS` characters (about 1k-4k tokens),
  pasted with a task on it (explain, summarise, test, type, review, refactor): the long code prompts of chat users.

`code-functions-2` and `code-files-2` are the same prompts over `MORE_CODE_PACKAGES` (pydash, toolz: MIT / BSD;
small functions whose docstrings show calls and results, as HumanEval's do). They are sources of their own, not
more packages in the first two, so a corpus built from the first two keeps its prompts and their shuffled order.

Instructions and tasks rotate through fixed lists, so the prompts are the same on every machine. Records are
`{"id", "source", "messages"}` as in `sources.py`; ids name the package, module and function (or first line).

    >>> from hf_dflash.data.sources import load_source   # where the two sources are registered
    >>> load_source("code-functions", limit=1)[0]["id"]
    'code-functions:boltons/cacheutils.py:make_cache_key'
"""

from __future__ import annotations

import ast
from pathlib import Path

CODE_PACKAGES = ("boltons", "more-itertools")  # names in sources.DATA_FILES
MORE_CODE_PACKAGES = ("pydash", "toolz")
FILE_CHARS = (4000, 12000)  # a code-files chunk's size in characters: [shortest, longest]

FUNCTION_INSTRUCTIONS = (
    "Implement this Python function so that it does what its docstring says:",
    "Complete the following function. Return the whole function.",
    "Write the body of this function:",
    "Here is a function signature with its documentation. Write an implementation.",
)
FILE_TASKS = (
    "Explain what this Python code does, one function or class at a time.",
    "Write pytest unit tests for `{name}` in this code.",
    "Summarise this module in a few sentences, then list its public functions and classes.",
    "Add type hints to `{name}` and return the whole function.",
    "Review this code: is there a bug, or an input `{name}` does not handle well? Explain, then fix it.",
    "Rewrite `{name}` to be shorter and clearer without changing its behaviour.",
    "What does `{name}` return, and when would I use it? Give a short example.",
)


def first_line(node: ast.stmt) -> int:
    """The statement's first line, its decorators included."""
    return min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])


def documented_functions(tree: ast.Module) -> list[tuple[str | None, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(class name or None, function) for each public top-level function, and each public method of a public
    top-level class, that has a docstring, in source order."""
    found = []
    for node in tree.body:
        members = [(None, node)]
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            members = [(node.name, member) for member in node.body]
        for owner, function in members:
            if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef) and not function.name.startswith("_"):
                if ast.get_docstring(function) is not None:
                    found.append((owner, function))
    return found


def function_prompts(package: str, module: str, source: str) -> list[tuple[str, str]]:
    """(key, prompt) for each documented function of `source` (`documented_functions`): its decorators,
    signature and docstring (under a `class` line for a method), fenced, after an instruction from
    `FUNCTION_INSTRUCTIONS` (rotating)."""
    lines = source.splitlines()
    prompts = []
    for owner, node in documented_functions(ast.parse(source)):
        header = "\n".join(lines[first_line(node) - 1 : node.body[0].end_lineno])
        if owner is not None:
            header = f"class {owner}:\n{header}"
        instruction = FUNCTION_INSTRUCTIONS[len(prompts) % len(FUNCTION_INSTRUCTIONS)]
        key = node.name if owner is None else f"{owner}.{node.name}"
        prompts.append((f"{package}/{module}:{key}", f"{instruction}\n```python\n{header}\n```"))
    return prompts


def band_sizes(shortest: int, longest: int) -> list[int]:
    """The sizes a cut rotates over so its pieces spread over [shortest, longest]: shortest, a third and two thirds
    of the way to longest."""
    return [shortest + step * (longest - shortest) // 3 for step in range(3)]


def file_chunks(source: str, shortest: int, longest: int) -> list[tuple[int, str, str | None]]:
    """Runs of consecutive top-level statements of `source` (comments between them kept). A run closes once it
    holds at least its size, which rotates over `shortest`, a third and two thirds of the way to `longest` (the
    prompts spread over the band); a run over `longest` (a huge class) is dropped, as is a short tail.
    Returns (first line, text, first public function or class defined in it, else None)."""
    lines = source.splitlines()
    sizes = band_sizes(shortest, longest)
    chunks, start, name = [], None, None
    for node in ast.parse(source).body:
        if start is None:
            start, name = first_line(node), None
        defines = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        if name is None and defines and not node.name.startswith("_"):
            name = node.name
        text = "\n".join(lines[start - 1 : node.end_lineno]).strip("\n")
        if len(text) >= sizes[len(chunks) % len(sizes)]:
            if len(text) <= longest:
                chunks.append((start, text, name))
            start = None
    return chunks


def file_prompts(package: str, module: str, source: str) -> list[tuple[str, str]]:
    """(key, prompt) for each chunk of `source` (`file_chunks` of `FILE_CHARS`): a task from `FILE_TASKS`
    (rotating; tasks naming a function skip chunks that define none), then the fenced code, or the code first
    for every other chunk (users paste both ways)."""
    prompts = []
    for index, (line, text, name) in enumerate(file_chunks(source, *FILE_CHARS)):
        tasks = [task for task in FILE_TASKS if name is not None or "{name}" not in task]
        task = tasks[index % len(tasks)].format(name=name)
        code = f"```python\n{text}\n```"
        prompt = f"{task}\n\n{code}" if index % 2 == 0 else f"{code}\n\n{task}"
        prompts.append((f"{package}/{module}:{line}", prompt))
    return prompts


def package_modules(name: str, locate) -> list[tuple[str, str]]:
    """(module file name, source) of each top-level module of data package `name`, sorted by file name."""
    folder: Path = locate(name)
    return [(path.name, path.read_text(encoding="utf-8")) for path in sorted(folder.glob("*.py"))]


def code_prompts(
    make_prompts, locate, limit: int | None, packages: tuple[str, ...] = CODE_PACKAGES
) -> list[tuple[str, str]]:
    """(key, prompt) pairs of `make_prompts(package, module, source)` over every module of `packages` (found by
    `locate`, which checks their hashes), at most `limit`; `sources.py` makes them records."""
    prompts = []
    for package in packages:
        for module, source in package_modules(package, locate):
            prompts.extend(make_prompts(package, module, source))
            if limit is not None and len(prompts) >= limit:
                return prompts[:limit]
    return prompts
