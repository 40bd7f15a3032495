"""The documentation as written: every flag, test and path it names exists, and its commands that need no training
run."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import OFFLINE, REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def page_text(page) -> str:
    """The page with shell line continuations joined and quoted arguments ('|', "a b") made plain words."""
    text = page.read_text(encoding="utf-8").replace("\\\n", " ")
    return re.sub(r"'[^'\n]*'|\"[^\"\n]*\"", "QUOTED", text)


def documented_train_flags() -> dict[str, set[str]]:
    """Every --flag in a `python train.py` or `accelerate launch ... train.py` command, by page."""
    command = re.compile(r"(?:python\s+train\.py|accelerate\s+launch\b[^\n`|]*?\btrain\.py)([^\n`#|;&)]*)")
    return {page.name: {flag for tail in command.findall(page_text(page))
                        for flag in re.findall(r"(?<!\S)--[A-Za-z][\w-]*", tail)} for page in PAGES}


def documented_outputs() -> set[str]:
    """What the examples write: export's target folder, predict's --output, report's --output_dir."""
    found = set()
    for page in PAGES:
        text = page_text(page)
        found |= set(re.findall(r"python -m textclf\.export\s+\S+\s+([^\s`]+)", text))
        found |= set(re.findall(r"-m textclf\.(?:predict|report)\b[^\n`]*?--output(?:_dir)?\s+([^\s`]+)", text))
    return found


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(page, command, what the page shows it printing) for each command of the pages: every line of a
    ```bash block (continuation lines joined), and every `$ ` line of a plain block with the lines after it."""
    found = []
    for page in PAGES:
        block, shown = None, None
        for line in page.read_text(encoding="utf-8").replace("\\\n", " ").splitlines():
            if line.startswith("```"):
                block, shown = (None if block is not None else line[3:]), None
            elif block == "bash" and line.strip():
                found.append((page.name, line.strip(), []))
            elif block == "" and line.startswith("$ "):
                shown = []
                found.append((page.name, line[2:].strip(), shown))
            elif shown is not None:
                shown.append(line)
    return found


# What a test cannot run as written here, and why; everything else the pages give is run below.
NOT_RUN = {
    r"^python3 -m venv|pip install": "the setup, which CI runs on a clean clone",
    r"-m pytest": "the test suite itself",
    r"\bsbatch\b": "needs SLURM",
    r"scripts/gpu_": "needs a GPU machine (docs/gpu.md)",
    r"--model (?![./]|checkpoints/)[\w.-]+/|--model bert-base-chinese": "a hub model: needs the network",
    r"--metric (?![./])[\w:-]+": "a Hub metric: needs the network, or evaluate's cache (tasks/test_scores.py)",
    r"\btrain\.py\b": "trains: journeys/test_train.py, journeys/test_zoo.py and models/test_build.py run it so",
    r"textclf\.(export|predict|report)\b": "needs a trained model: test_export.py, test_predict.py, test_report.py",
    r"-m benchmarks": "takes minutes: journeys/test_bench.py runs it --quick",
    r"^accelerate config\s*(#|$)": "asks its questions on a terminal",
}


def missing_lines(shown: list[str], printed: str) -> list[str]:
    """The lines the page shows that the command did not print: a `label   value` line by its label
    (values depend on the machine and the cache), any other line whole."""
    printed_lines = printed.splitlines()
    missing = []
    for line in shown:
        if line.strip() in ("", "...") or line.startswith(" "):
            continue
        label = re.split(r"\s{2,}", line)[0]
        wanted = ((lambda got: re.match(re.escape(label) + r"\s{2,}", got)) if label != line
                  else (lambda got: got == line))
        if not any(wanted(got) for got in printed_lines):
            missing.append(line)
    return missing


def test_every_flag_the_documentation_gives_train_py_exists():
    result = subprocess.run([sys.executable, "train.py", "--help"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    documented = documented_train_flags()
    assert set().union(*documented.values()) >= {"--resume", "--model", "--lora", "--per_device_train_batch_size"}
    known = set(re.findall(r"(?<!\S)--[A-Za-z][\w-]*", result.stdout))
    missing = {page: sorted(flags - known) for page, flags in documented.items() if flags - known}
    assert not missing, f"flags in the documentation that train.py does not have: {missing}"


def test_every_test_the_documentation_names_exists():
    """docs/faults.md and docs/gpu.md say which test covers what: a renamed test must not leave them stale.
    A name ending in * or ... stands for every test it begins."""
    files = sorted((REPO / "tests").rglob("test_*.py"))
    where = {name: path.relative_to(REPO / "tests").as_posix() for path in files
             for name in re.findall(r"^def (test_\w+)", path.read_text(encoding="utf-8"), re.M)}
    defined = {path.stem for path in files} | set(where)
    # A test named with its file (`checkpointing/test_load.py::test_...`) is in that file.
    misplaced = sorted({f"{file}::{name} (in {where[name]})" for page in PAGES for file, name in re.findall(
        r"([\w/]*test_\w+\.py)::(test_\w+)", page_text(page)) if name in where and not where[name].endswith(file)})
    assert not misplaced, f"tests the documentation names in another file than theirs: {misplaced}"
    named = {page.name: re.findall(r"(?<![\w-])(test_\w+?)(\*|\.\.\.)?(?![\w*])", page_text(page)) for page in PAGES}
    assert len(named["faults.md"]) > 20 and len(named["gpu.md"]) > 20
    # A test whose code the page shows (docs/tasks.md's worked example, which tasks/test_task.py runs) is defined there.
    shown = {page.name: set(re.findall(r"^def (test_\w+)", page.read_text(encoding="utf-8"), re.M)) for page in PAGES}
    unknown = {page: sorted(name + (wildcard or "") for name, wildcard in names if not (
        any(d.startswith(name) for d in defined) if wildcard else name in defined | shown[page]))
        for page, names in named.items()}
    assert not any(unknown.values()), f"tests named in the documentation that tests/ does not define: {unknown}"


def test_what_the_readme_s_examples_write_is_ignored_by_git():
    outputs = documented_outputs()
    assert outputs >= {"exported/", "merged/", "out.jsonl", "out.csv", "report/"}
    tracked = [path for path in sorted(outputs) if not path.startswith("checkpoints/") and subprocess.run(
        ["git", "check-ignore", "-q", "--no-index", path + ("example" if path.endswith("/") else "")],
        cwd=REPO).returncode != 0]
    assert not tracked, f"outputs of documented commands that git would show as untracked: {tracked}"


@pytest.mark.slow
def test_the_documented_commands_that_need_no_training_run_as_written(tmp_path):
    """Run in the repository root as a user would type them (the virtual environment's python and
    accelerate first on PATH), in order, with accelerate's config folder in tmp_path: what the page shows
    them print is printed, and they succeed unless the page shows a conflict or an error."""
    from torch.utils.cpp_extension import get_default_build_root

    # A home of its own too: a scratch tokenizer in the user's ~/.cache/textclf would have the check read the
    # default data, and build the default corpus in the repository's data/ (conftest's guard). DeepSpeed's ops
    # stay where they were compiled.
    env = {**os.environ, **OFFLINE, "HF_HOME": str(tmp_path / "huggingface"), "HOME": str(tmp_path / "home"),
           "TORCH_EXTENSIONS_DIR": get_default_build_root(),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    ran = []
    for page, command, shown in documented_commands():
        if any(re.search(pattern, re.sub(r"\s+#.*", "", command)) for pattern in NOT_RUN):
            continue
        result = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=300)
        printed = result.stdout + result.stderr
        refused = any(line.startswith(("conflict:", "error:")) for line in shown)
        assert (result.returncode != 0) == refused, f"{page}: {command}\n{printed[-3000:]}"
        assert not missing_lines(shown, printed), f"{page}: {command} did not print\n{printed[-3000:]}"
        ran.append(command)
    assert any("accelerate config default" in command for command in ran)
    assert sum("textclf.check" in command for command in ran) >= 4, ran


def test_every_path_the_documentation_names_exists():
    """A file or folder of the project's named in README.md, docs/ or data/README.md is there: a module or test
    moved must not leave a page pointing at nothing. Paths the reader makes (a kind of their own) are written
    without their folder."""
    pages = [*PAGES, REPO / "data" / "README.md"]
    named = {page.name: set(re.findall(r"(?<![\w./-])((?:textclf|tests|scripts|benchmarks)/[\w/.-]*\w)",
                                        page.read_text(encoding="utf-8"))) for page in pages}
    missing = {page: sorted(path for path in paths if not (REPO / path).exists()) for page, paths in named.items()}
    assert not any(missing.values()), f"paths the documentation names that the project does not have: {missing}"
