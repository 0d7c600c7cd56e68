"""Size and coupling figures of the dpex package, for reviews and issue notes.

    python scripts/code_metrics.py [PACKAGE_DIR]

Prints the longest functions (lines from ``def`` to its last line), how many are over
60 lines (tests/test_layout.py keeps that at none), the longest modules, and the
private attributes read across modules: ``x._name`` (or ``getattr(x, "_name")``)
where ``x`` is not ``self``/``cls`` and ``_name`` is not defined in the reading module
(a function, class, assignment or argument of that name), dunders excluded. Each such
name is listed with the modules that read it.
"""

from __future__ import annotations

import ast
import collections
import pathlib
import sys


def defined_names(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def private_read(node: ast.AST) -> tuple[str, ast.AST] | None:
    """(name, owner) of a private attribute read, else None."""
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
        return node.attr, node.value
    if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "getattr"
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)):
        return node.args[1].value, node.args[0]
    return None


def main(root: pathlib.Path) -> None:
    trees = {path: ast.parse(path.read_text()) for path in sorted(root.rglob("*.py"))}
    functions = sorted(((node.end_lineno - node.lineno + 1, f"{path}:{node.name}")
                        for path, tree in trees.items() for node in ast.walk(tree)
                        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))),
                       reverse=True)
    print("longest functions:", ", ".join(f"{name} {lines}" for lines, name in functions[:8]))
    print("functions over 60 lines:", sum(lines > 60 for lines, _ in functions))
    modules = sorted(((len(p.read_text().splitlines()), str(p)) for p in trees), reverse=True)
    print("longest modules:", ", ".join(f"{name} {lines}" for lines, name in modules[:6]))
    readers: dict[str, set[str]] = collections.defaultdict(set)
    for path, tree in trees.items():
        own = defined_names(tree)
        for node in ast.walk(tree):
            read = private_read(node)
            if read is None:
                continue
            name, owner = read
            if not name.startswith("_") or name.startswith("__") or name in own:
                continue
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            readers[name].add(str(path))
    print("private attributes read from another module:", len(readers))
    for name, paths in sorted(readers.items()):
        print(f"  {name}: {', '.join(sorted(paths))}")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "dpex"))
