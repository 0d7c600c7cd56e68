"""The package's layout: one import direction, no import circle (no Ray, no sockets).

    dpex/dataloader.py, cli.py, accelerate.py, __init__.py   the facade: may import all
    dpex/client/   the trainer's side   ->  shared modules
    dpex/server/   the workers' side    ->  shared modules
    dpex/_*.py, errors.py               shared: import neither side
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "dpex"
FACADE = {"dpex", "dpex.dataloader", "dpex.cli", "dpex.accelerate"}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def dpex_imports(path: pathlib.Path, top_level_only: bool) -> set[str]:
    """The dpex modules ``path`` imports (``from dpex import x`` counts as dpex.x when
    that is a module); with ``top_level_only``, only imports run at import time."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    known = modules()
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "dpex"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "dpex":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
    return found


def side(module: str) -> str:
    if module in FACADE:
        return "facade"
    if module.startswith("dpex.client"):
        return "client"
    if module.startswith("dpex.server"):
        return "server"
    return "shared"


ALLOWED = {"client": {"client", "shared"}, "server": {"server", "shared"},
           "shared": {"shared"}, "facade": {"facade", "client", "server", "shared"}}


@pytest.mark.parametrize("module", sorted(modules()))
def test_imports_go_one_way(module):
    wrong = sorted(m for m in dpex_imports(modules()[module], top_level_only=False)
                   if side(m) not in ALLOWED[side(module)])
    assert not wrong, f"{module} ({side(module)}) imports {wrong}"


def test_no_import_circle():
    # Lazy imports (inside functions) count too: they only hide a circle.
    graph = {m: dpex_imports(p, top_level_only=False) - {m} for m, p in modules().items()}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(module):]
                                                                 + [module]))
        if module in done:
            return
        for dep in sorted(graph.get(module, ())):
            if dep != "dpex":  # every submodule's package: imported first, not a circle
                visit(dep, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_the_package_map_gives_every_module_a_line():
    listed = (PACKAGE / "README.md").read_text()
    files = [p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py")]
    # (the sides' empty __init__.py files are no modules of their own)
    missing = sorted(str(f) for f in files if f"`{f}`" not in listed
                     and not (f.name == "__init__.py" and len(f.parts) > 1))
    assert not missing, f"dpex/README.md has no line for {missing}"


def test_the_loader_takes_every_dpex_setting_by_its_name_and_default():
    import dataclasses
    import inspect

    from dpex import DpexConfig, DpexDataLoader

    params = inspect.signature(DpexDataLoader.__init__).parameters
    fields = dataclasses.fields(DpexConfig)
    for f in fields:
        assert f.name in params, f"DpexConfig.{f.name} is no DpexDataLoader argument"
        assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY, f.name
        assert params[f.name].default == f.default, f.name
    torch_params = inspect.signature(DpexDataLoader.__mro__[1].__init__).parameters
    extra = set(params) - set(torch_params) - {"in_order"}
    assert extra == {f.name for f in fields}, "a DpexDataLoader argument is not in DpexConfig"
    loader = DpexDataLoader([1, 2], lost_batch_timeout=3.0, worker_pool="prep")
    assert loader.lost_batch_timeout == 3.0 and loader.dpex_config.worker_pool == "prep"
    assert loader.ray_remote_args == {} and loader.dpex_config.ray_remote_args == {}


# Size limits kept since issue 42: a function fits on a screen, a module is read in one
# sitting, and the driver (the iterator's busiest collaborator) stays well under that.
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 650
MODULE_LIMITS = {"client/_driver.py": 450}


def functions(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_function_is_longer_than_a_screen():
    long = sorted((n.end_lineno - n.lineno + 1, f"{path.relative_to(PACKAGE)}:{n.name}")
                  for path in PACKAGE.rglob("*.py")
                  for n in functions(ast.parse(path.read_text())))[::-1]
    over = [(lines, name) for lines, name in long if lines > MAX_FUNCTION_LINES]
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines: {over}"


def test_modules_stay_within_their_size():
    over = []
    for path in PACKAGE.rglob("*.py"):
        name = str(path.relative_to(PACKAGE))
        lines = len(path.read_text().splitlines())
        limit = MODULE_LIMITS.get(name, MAX_MODULE_LINES)
        if lines >= limit:
            over.append(f"{name}: {lines} lines (limit: under {limit})")
    assert not over, over


# torch's iterators' private attributes that saving a state needs: read by one adapter
# (dpex's own iterator, a subclass, reads its own through ``self``).
TORCH_ITERATOR_PRIVATES = {"_sampler_iter", "_num_yielded", "_dataset_fetcher"}
POSITION_ADAPTER = "client/resume/_position.py"


def test_only_the_position_adapter_reads_torchs_iterators_private_attributes():
    readers = set()
    for path in PACKAGE.rglob("*.py"):
        name = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            attr = node.attr if isinstance(node, ast.Attribute) else (
                node.args[1].value if isinstance(node, ast.Call)
                and getattr(node.func, "id", "") == "getattr" and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant) else None)
            if attr not in TORCH_ITERATOR_PRIVATES:
                continue
            owner = node.value if isinstance(node, ast.Attribute) else node.args[0]
            if not (isinstance(owner, ast.Name) and owner.id == "self"):
                readers.add(name)
    assert readers == {POSITION_ADAPTER}, readers
