"""Size and coupling figures of the dpex package, for reviews and issue notes.

    python scripts/code_metrics.py [PACKAGE_DIR]

Prints the longest functions (lines from ``def`` to its last line), how many are over
60 lines (tests/test_layout.py keeps that at none), the longest modules, and the
private attributes used across modules: ``x._name`` read or stored (or
``getattr(x, "_name")``, ``setattr(x, "_name", ...)``, ``x.__dict__["_name"]`` and
its ``get`` / ``pop`` / ``setdefault``) where ``x`` is not ``self``/``cls`` and
``_name`` is not defined in the using module (a function, class, argument, plain
assignment or ``self._name = ...``), dunders excluded. A store into another object
is a use, not a definition: it is what couples two modules most. Each name is listed
with the modules that use it, dpex's own names apart from the libraries' (a name the
source of a package dpex imports, or the standard library, uses: torch's iterator's
``_num_yielded``, NumPy's ``_bit_generator``).
"""

from __future__ import annotations

import ast
import collections
import importlib.util
import pathlib
import re
import sys
import sysconfig

_SELF = ("self", "cls")
_DICT_METHODS = ("get", "pop", "setdefault")


def defined_names(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and _owner_is_self(node.value)):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def _owner_is_self(owner: ast.AST) -> bool:
    return isinstance(owner, ast.Name) and owner.id in _SELF


def _constant_str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _instance_dict(node: ast.AST) -> ast.AST | None:
    """``x`` of ``x.__dict__``, else None."""
    if isinstance(node, ast.Attribute) and node.attr == "__dict__":
        return node.value
    return None


def private_use(node: ast.AST) -> tuple[str, ast.AST] | None:
    """(name, owner) of an attribute read or stored by name, else None."""
    if isinstance(node, ast.Attribute):
        return node.attr, node.value
    if isinstance(node, ast.Call) and len(node.args) >= 2:
        func = getattr(node.func, "id", "")
        name = _constant_str(node.args[1])
        if func in ("getattr", "setattr", "hasattr", "delattr") and name is not None:
            return name, node.args[0]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in _DICT_METHODS and node.args):
        owner, name = _instance_dict(node.func.value), _constant_str(node.args[0])
        if owner is not None and name is not None:
            return name, owner
    if isinstance(node, ast.Subscript):
        owner, name = _instance_dict(node.value), _constant_str(node.slice)
        if owner is not None and name is not None:
            return name, owner
    return None


def cross_module_uses(trees: dict[pathlib.Path, ast.AST]) -> dict[str, set[str]]:
    users: dict[str, set[str]] = collections.defaultdict(set)
    for path, tree in trees.items():
        own = defined_names(tree)
        for node in ast.walk(tree):
            use = private_use(node)
            if use is None:
                continue
            name, owner = use
            if not name.startswith("_") or name.startswith("__") or name in own:
                continue
            if _owner_is_self(owner):
                continue
            users[name].add(str(path))
    return users


def imported_packages(trees: dict[pathlib.Path, ast.AST], root: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return names - {root.name}


def library_names(names: set[str], packages: set[str]) -> set[str]:
    """Which of ``names`` the source of ``packages`` or the standard library uses."""
    if not names:
        return set()
    dirs = [pathlib.Path(sysconfig.get_paths()["stdlib"])]
    for package in sorted(packages):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        if spec is None or spec.origin in (None, "built-in", "frozen"):
            continue
        origin = pathlib.Path(spec.origin)
        dirs.append(origin.parent if origin.name == "__init__.py" else origin)
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(names))) + r")\b")
    found: set[str] = set()
    for place in dirs:
        files = [place] if place.is_file() else place.rglob("*.py")
        for path in files:
            if "site-packages" in path.parts and place.name == "python3" + path.suffix:
                continue
            try:
                found.update(pattern.findall(path.read_text(errors="ignore")))
            except OSError:
                continue
            if found == names:
                return found
    return found


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
    users = cross_module_uses(trees)
    libraries = library_names(set(users), imported_packages(trees, root))
    for title, names in (("dpex's own", sorted(set(users) - libraries)),
                         ("libraries'", sorted(libraries))):
        print(f"private attributes used from another module, {title}: {len(names)}")
        for name in names:
            print(f"  {name}: {', '.join(sorted(users[name]))}")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "dpex"))
