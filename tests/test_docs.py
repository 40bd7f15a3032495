"""The documentation against the code: every train.py flag that the README and docs/*.md name exists, and what
the README's examples write is ignored by git. Pages added to docs/ later are covered too."""

import re
import subprocess
import sys

from conftest import REPO

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


def test_every_flag_the_documentation_gives_train_py_exists():
    result = subprocess.run([sys.executable, "train.py", "--help"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    documented = documented_train_flags()
    assert set().union(*documented.values()) >= {"--resume", "--model", "--lora", "--per_device_train_batch_size"}
    known = set(re.findall(r"(?<!\S)--[A-Za-z][\w-]*", result.stdout))
    missing = {page: sorted(flags - known) for page, flags in documented.items() if flags - known}
    assert not missing, f"flags in the documentation that train.py does not have: {missing}"


def documented_outputs() -> set[str]:
    """What the examples write: export's target folder, predict's --output, report's --output_dir."""
    found = set()
    for page in PAGES:
        text = page_text(page)
        found |= set(re.findall(r"python -m textclf\.export\s+\S+\s+([^\s`]+)", text))
        found |= set(re.findall(r"-m textclf\.(?:predict|report)\b[^\n`]*?--output(?:_dir)?\s+([^\s`]+)", text))
    return found


def test_what_the_readme_s_examples_write_is_ignored_by_git():
    outputs = documented_outputs()
    assert outputs >= {"exported/", "merged/", "out.jsonl", "out.csv", "report/"}
    tracked = [path for path in sorted(outputs) if not path.startswith("checkpoints/") and subprocess.run(
        ["git", "check-ignore", "-q", "--no-index", path + ("example" if path.endswith("/") else "")],
        cwd=REPO).returncode != 0]
    assert not tracked, f"outputs of documented commands that git would show as untracked: {tracked}"


