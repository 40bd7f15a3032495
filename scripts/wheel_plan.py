"""The packages a bare GPU machine lacks to run this project, with the versions installed here: read by
scripts/gpu_wheels.sh, which fetches their wheels. One `name version` line each (version `-` where the package is
not installed here: its newest wheel is fetched).

    python scripts/wheel_plan.py

The list follows the project's own dependencies (pyproject.toml: the core, and the extras a GPU run uses), each
with what it needs in turn, as installed here, for Linux x86-64 and CPython 3.12 (the GPU machine's), less what the
machine has already: CUDA images hold torch (which brings triton), accelerate, transformers and peft with what they
need, and the usual scientific stack (IMAGE_HAS).
"""

import importlib.metadata
import re
import sys
from pathlib import Path

import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
EXTRAS = ("deepspeed", "liger")  # the extras a GPU run uses
IMAGE_HAS = ("torch", "triton", "accelerate", "transformers", "peft", "numpy", "pandas", "pyarrow", "scipy",
             "scikit-learn", "matplotlib", "tensorboard", "pyyaml", "tqdm", "psutil", "ninja", "pytest")
# Needed by a package brought along, and had by the image only through packages newer than its own: the image's
# transformers (5.17) did not need pydantic, which this environment's has through typer; deepspeed needs it.
NEEDED_ANYWAY = ("pydantic",)
TARGET = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "os_name": "posix"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(name: str) -> list[str]:
    """What an installed package needs on the target (no extras); [] where it is not installed here."""
    try:
        requires = importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    needed = []
    for text in requires:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate({**TARGET, "extra": ""}):
            needed.append(canonical(requirement.name))
    return needed


def closure(names) -> set[str]:
    seen, todo = set(), [canonical(n) for n in names]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += requirements(name)
    return seen


def project_requirements() -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    texts = project["dependencies"] + [t for extra in EXTRAS for t in project["optional-dependencies"][extra]]
    return [canonical(Requirement(text).name) for text in texts]


def plan() -> list[tuple[str, str]]:
    missing = closure(project_requirements()) - closure(IMAGE_HAS) | closure(NEEDED_ANYWAY) - closure(["torch"])
    rows = []
    for name in sorted(missing):
        try:
            rows.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            rows.append((name, "-"))
    return rows


if __name__ == "__main__":
    sys.stdout.write("".join(f"{name} {version}\n" for name, version in plan()))
