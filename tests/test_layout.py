"""The package's house: one concept per folder behind an __init__ that names what the others use, imports that point one
way (import-linter's contracts in pyproject.toml), and the launch's environment read in one place."""

import ast
import re
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "textclf"


def modules() -> dict[str, str]:
    """Every module of textclf by its dotted name, with its source."""
    return {".".join(path.relative_to(REPO).with_suffix("").parts): path.read_text(encoding="utf-8")
            for path in sorted(PACKAGE.rglob("*.py"))}


def folders() -> list[str]:
    return sorted(path.parent.name for path in PACKAGE.glob("*/__init__.py"))


def exported(folder: str) -> list[str]:
    init = ast.parse((PACKAGE / folder / "__init__.py").read_text(encoding="utf-8"))
    return next((ast.literal_eval(node.value) for node in init.body
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "__all__"), [])


def test_lint_imports_keeps_the_layers_and_finds_no_import_circle():
    """Counting every import, those inside functions too: the commands down to the error path, never up, and no two
    modules that import each other, directly or through others."""
    lint = subprocess.run([Path(sys.executable).with_name("lint-imports")], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert "2 kept, 0 broken" in lint.stdout


def test_each_folder_names_what_the_others_use_and_nothing_else():
    """A folder's __init__ says what it is (its docstring) and names, in __all__, what production code outside it
    uses (train.py, the commands, the other folders, the benchmark and scripts): a name only tests use is not part of
    its face, as tests import the module they test."""
    production = [*PACKAGE.rglob("*.py"), REPO / "train.py", *(REPO / "benchmarks").glob("*.py"),
                  *(REPO / "scripts").glob("*.py")]
    for folder in folders():
        init = ast.parse((PACKAGE / folder / "__init__.py").read_text(encoding="utf-8"))
        assert ast.get_docstring(init), folder
        used = set()
        for path in production:
            if PACKAGE / folder in path.parents:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            as_module = {alias.asname or alias.name for node in ast.walk(tree)
                         if isinstance(node, ast.ImportFrom) and node.module == "textclf"
                         for alias in node.names if alias.name == folder}
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module == f"textclf.{folder}":
                    used |= {alias.name for alias in node.names}
                elif isinstance(node, ast.Attribute) and getattr(node.value, "id", None) in as_module:
                    used.add(node.attr)
        names = exported(folder)
        assert not set(names) - used, f"textclf.{folder} names what no production code outside it uses: " \
                                      f"{sorted(set(names) - used)}"
        assert not used - set(names), f"textclf.{folder} does not name what others use: {sorted(used - set(names))}"


def test_other_folders_import_a_folder_through_its_init():
    """`from textclf.checkpointing import plan_start`, never a module inside another folder: what a folder's
    __init__ does not name is its own business."""
    reaching_in = []
    for name, source in modules().items():
        folder = name.split(".")[1] if name.count(".") >= 2 else None
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").count(".") >= 2:
                target = node.module.split(".")
                if target[0] == "textclf" and target[1] != folder:
                    reaching_in.append(f"{name}: from {node.module} import ...")
    assert not reaching_in, reaching_in


def test_the_launch_s_environment_is_read_in_one_place():
    """What `accelerate launch` or torchrun set (WORLD_SIZE, RANK, ACCELERATE_*) is read by launch_environment();
    the error path reads the rank and world size itself, as it must work whatever else has failed."""
    launch_variable = re.compile(r"[\"'](WORLD_SIZE|RANK|LOCAL_RANK|GROUP_WORLD_SIZE|ACCELERATE_\w+)[\"']")
    readers = sorted(name for name, source in modules().items()
                     if "os.environ" in source and launch_variable.search(source))
    assert readers == ["textclf.errors", "textclf.launch.launcher"], readers
