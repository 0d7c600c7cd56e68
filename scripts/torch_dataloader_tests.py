"""Run PyTorch's own DataLoader tests with torch's DataLoader and with dpex, side by side.

    python scripts/torch_dataloader_tests.py PATH/TO/pytorch/test/test_dataloader.py \\
        [-k "TestDataLoader and not Persistent"] [--out docs/torch_tests.md]

PyTorch's test file is not part of its wheel (nor of this repository): take it from a
PyTorch checkout of the installed version. Each test runs twice, in two pytest
processes: once as written, once with every ``DataLoader`` it builds replaced by a
DpexDataLoader with ``distribute_mode=True`` (``scripts/dpex_everywhere.py``), on
the embedded default Ray of this machine. The result is a markdown table with each
test's outcome under both, and which tests ask for more workers than this machine
has cores. Needs ``pip install expecttest psutil hypothesis`` (PyTorch's test
helpers). Prints one line per finished test run as it goes.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def outcomes(junit: str) -> dict[str, str]:
    """``Class::test`` → passed / failed / error / skipped, from a junit XML file."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        kinds = {child.tag for child in case}
        result[name] = ("failed" if "failure" in kinds else "error" if "error" in kinds
                        else "skipped" if "skipped" in kinds else "passed")
    return result


def _ints(node: ast.AST) -> list[int]:
    """The integer constants ``node`` is or lists (``4``, ``[0, 4]``, ``(1, 2)``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return [node.value]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [v for elt in node.elts for v in _ints(elt)]
    return []


def _largest(func: ast.FunctionDef, funcs: dict[str, ast.FunctionDef], seen: set[str]) -> int:
    best = 0
    for node in ast.walk(func):
        if isinstance(node, ast.keyword) and node.arg == "num_workers":
            best = max([best, *_ints(node.value)])
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "num_workers" for t in node.targets):
            best = max([best, *_ints(node.value)])
        elif isinstance(node, ast.For) and isinstance(node.target, ast.Name) and \
                node.target.id == "num_workers":
            best = max([best, *_ints(node.iter)])
        elif isinstance(node, ast.Attribute) and node.attr in funcs and node.attr not in seen:
            best = max(best, _largest(funcs[node.attr], funcs, seen | {node.attr}))
    return best


def workers_asked(path: str) -> dict[str, int]:
    """The largest ``num_workers`` each test function of ``path`` writes as a number
    (0: none), including in the helpers of its class (or of the classes of this file it
    inherits from) that it calls."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
        found: dict[str, ast.FunctionDef] = {}
        for base in cls.bases:  # inherited first, so the class's own win
            if isinstance(base, ast.Name) and base.id in classes:
                found.update(methods(classes[base.id]))
        found.update({f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)})
        return found

    most: dict[str, int] = {}
    for cls in classes.values():
        funcs = methods(cls)
        for name, func in funcs.items():
            if name.startswith("test"):
                most[f"{cls.name}::{name}"] = _largest(func, funcs, {name})
    return most


def run(path: str, select: str, dpex: bool, junit: str, timeout: float) -> float:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, ROOT, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "pytest", path, "-v", "-p", "no:cacheprovider",
           "--timeout", "300", f"--junitxml={junit}", "-k", select]
    if dpex:
        cmd[4:4] = ["-p", "dpex_everywhere"]
    t0 = time.monotonic()
    with subprocess.Popen(cmd, env=env, cwd=os.path.dirname(os.path.abspath(path)),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:  # pytest's own progress dots and summary
            if line.strip():
                print(("dpex  | " if dpex else "torch | ") + line.rstrip(), flush=True)
        proc.wait(timeout)
    return time.monotonic() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("test_file")
    p.add_argument("-k", default="TestDataLoader and not Persistent and not DeviceType",
                   help="which tests (pytest -k)")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    p.add_argument("--timeout", type=float, default=7200)
    args = p.parse_args()
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        seconds = {}
        for dpex in (False, True):
            junit = os.path.join(tmp, f"{'dpex' if dpex else 'torch'}.xml")
            seconds[dpex] = run(args.test_file, args.k, dpex, junit, args.timeout)
        torch_out = outcomes(os.path.join(tmp, "torch.xml"))
        dpex_out = outcomes(os.path.join(tmp, "dpex.xml"))
    asked = workers_asked(args.test_file)
    lines = [f"PyTorch's {os.path.basename(args.test_file)} (-k {args.k!r}), {cores} cores; "
             f"torch {seconds[False]:.0f} s, dpex {seconds[True]:.0f} s.", "",
             "| test | num_workers asked | torch | dpex |", "|---|---:|---|---|"]
    for name in sorted(torch_out):
        lines.append(f"| {name} | {asked.get(name, 0) or ''}"
                     f"{' (> cores)' if asked.get(name, 0) > cores else ''} | "
                     f"{torch_out[name]} | {dpex_out.get(name, 'not run')} |")
    over = [n for n in torch_out if asked.get(n, 0) > cores]
    same = [n for n in over if torch_out[n] == dpex_out.get(n)]
    lines += ["", f"Tests with num_workers > {cores} cores: {len(over)}; same outcome under "
              f"dpex as under torch: {len(same)}."]
    differ = [n for n in torch_out if torch_out[n] != dpex_out.get(n)]
    lines.append(f"All tests with a different outcome: {', '.join(differ) or 'none'}.")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
