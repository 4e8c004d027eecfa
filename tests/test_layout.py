"""The layout: layers point one way, no import cycle, shipped files import only their flat siblings, the wheel installs
one top-level name."""

import ast
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dflash2.generation.export import MODEL_MODULES, SHIPPED_MODULES, flat_code_files

from helpers import assert_folders_load_without_dflash2

ROOT = Path(__file__).resolve().parents[1]
# lower number = lower layer; a module may import only modules of its own layer or below
LAYERS = {"deprecated": 0, "configuration_dflash2": 0, "modeling_dflash2": 1, "generation": 2, "tasks": 3,
          "model_args": 3, "word_problems": 3, "pairs": 3, "problems": 3, "training": 4, "benchmarks": 4, "serving": 5,
          "cli": 6, "__init__": 7}


def package_modules() -> dict[str, Path]:
    """dflash2's modules (dotted names below the package) -> file, tests and drafter folders left out, and folders that
    are no subpackage (no __init__.py: a user's run folder under the checkout holds exported drafters' .py files)."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        relative = path.relative_to(ROOT)
        if relative.parts[0] in ("tests", "drafters", "docs", "build") or relative.parts[0].startswith("."):
            continue
        if len(relative.parts) > 1 and not (ROOT / relative.parts[0] / "__init__.py").is_file():
            continue
        parts = list(relative.with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module of the package that `name` imports, at module level or inside functions."""
    package = name.rsplit(".", 1)[0] if "." in name and not path.name == "__init__.py" else (
        name if path.name == "__init__.py" else "")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("dflash2"):
                target = node.module[len("dflash2."):] if node.module != "dflash2" else ""
            else:
                continue
            candidates = [target] + [f"{target}.{alias.name}" if target else alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name[len("dflash2."):] for alias in node.names if alias.name.startswith("dflash2.")]
        else:
            continue
        for candidate in candidates:
            if candidate in modules and candidate != name:
                found.add(candidate)
    return found


def layer(name: str) -> int:
    return LAYERS[name.split(".")[0]]


def test_layers_point_one_way_and_peers_do_not_import_each_other():
    modules = package_modules()
    problems = []
    for name, path in modules.items():
        for imported in imports_of(name, path, modules):
            if layer(imported) > layer(name):
                problems.append(f"{name} (layer {layer(name)}) imports {imported} (layer {layer(imported)})")
            top, other = name.split(".")[0], imported.split(".")[0]
            if {top, other} == {"training", "benchmarks"}:
                problems.append(f"{name} imports its peer {imported}")
    assert not problems, problems


def test_no_import_cycle():
    modules = package_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    state = {}

    def visit(node, trail):
        if state.get(node) == "done":
            return
        assert state.get(node) != "open", "import cycle: " + " -> ".join(trail + [node])
        state[node] = "open"
        for child in sorted(graph[node]):
            if child != node.rsplit(".", 1)[0]:  # a submodule's own package (__init__) is no cycle by itself
                visit(child, trail + [node])
        state[node] = "done"

    for name in sorted(graph):
        visit(name, [])


def test_shipped_sources_import_only_shipped_modules_as_a_package():
    """The shipped sources import each other as a package (generation/ reaches the model files one level up), never
    through `dflash2.` (a drafter folder has no such package); their flat copies import only `from .<sibling>`."""
    shipped = set(SHIPPED_MODULES)
    for name in SHIPPED_MODULES:
        model_file = name in MODEL_MODULES
        path = ROOT / f"{name}.py" if model_file else ROOT / "generation" / f"{name}.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                expected = 1 if model_file or node.module not in MODEL_MODULES else 2
                assert node.level == expected and node.module in shipped, (name, node.module, node.level)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                assert not (module or "").startswith("dflash2"), (name, module)
    for exported, text in flat_code_files().items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and node.module in shipped, (exported, node.module, node.level)


def test_no_module_is_registered_under_another_name():
    """Nothing writes into sys.modules (an assignment, setdefault or update): the package imports as a package."""
    def writes_sys_modules(node) -> bool:
        def is_sys_modules(n) -> bool:
            return isinstance(n, ast.Attribute) and n.attr == "modules" and getattr(n.value, "id", "") == "sys"

        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            return any(isinstance(t, ast.Subscript) and is_sys_modules(t.value) for t in targets)
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_sys_modules(
            node.func.value) and node.func.attr in ("setdefault", "update", "__setitem__")

    assert any(map(writes_sys_modules, ast.walk(ast.parse("sys.modules.setdefault('a', b)"))))  # the check can fail
    writers = [name for name, path in package_modules().items()
               if any(writes_sys_modules(node) for node in ast.walk(ast.parse(path.read_text())))]
    assert not writers, writers


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="needs setuptools to build the wheel")
def test_the_wheel_installs_one_top_level_name(tmp_path):
    """Build the wheel from the tracked sources: its only top-level package is dflash2 (no `generation`,
    `training`, `benchmarks` beside a user's own folders), and it carries the code the CLI and the loops need, and the
    shipped drafter folder (every tracked file of it: `dflash2 generate`'s default drafter)."""
    import setuptools

    if tuple(int(x) for x in setuptools.__version__.split(".")[:2]) < (77, 0):
        pytest.skip(f"setuptools {setuptools.__version__} is older than the 77 pyproject.toml asks for")
    source = tmp_path / "src"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for relative in tracked:
        if relative.startswith("docs/"):
            continue
        (source / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / relative, source / relative)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, text=True)
    wheel = next((tmp_path / "dist").glob("dflash2-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert top_level == {"dflash2"}, top_level
    for needed in ("dflash2/__init__.py", "dflash2/modeling_dflash2.py", "dflash2/cli.py", "dflash2/model_args.py",
                   "dflash2/generation/round_core.py", "dflash2/generation/custom_generate/generate.py",
                   "dflash2/training/trainer.py", "dflash2/benchmarks/bench.py", "dflash2/benchmarks/speed.py",
                   "dflash2/benchmarks/acceptance.py", "dflash2/tasks.py"):
        assert needed in names, needed
    drafter = [name for name in tracked if name.startswith("drafters/SmolLM2-135M-Instruct-DFlash2/")]
    assert len(drafter) > 20 and "drafters/SmolLM2-135M-Instruct-DFlash2/model-00001-of-00002.safetensors" in drafter
    missing = [name for name in drafter if f"dflash2/{name}" not in names]
    assert not missing, missing
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "dflash2 = dflash2.cli:main" in entry_points
    # the drafter folder inside the installed wheel, outside the checkout, loads where dflash2 cannot be imported
    installed = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(installed), str(wheel)],
                   check=True, capture_output=True, text=True)
    folder = installed / "dflash2" / "drafters" / "SmolLM2-135M-Instruct-DFlash2"
    assert_folders_load_without_dflash2([folder], tmp_path)
