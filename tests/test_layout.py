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
