"""train.py, run in this process with every call that makes the host wait for the device recorded.

    SYNC_PROBE_OUT=syncs.json python tests/sync_probe.py <train.py's arguments>
    SYNC_PROBE_OUT=syncs.json accelerate launch --config_file ... tests/sync_probe.py <train.py's arguments>

A call that turns a tensor's value into a Python value (`.item()`, `.tolist()`, `.cpu()`, `.numpy()`,
`bool()`, `float()`, `int()`, an index, a format) must wait until the device has computed it: on a GPU
the host then stops queueing work until everything queued before has run. Each such call made from
Python is recorded with the optimizer step it falls in and where it was made. On CUDA, torch's own
sync debug mode also reports the synchronising operations that Python does not see (a blocking copy
of a batch to the device, `nonzero`, ...).

A call is counted in interval k when it happens after the k-th optimizer step (the k-th step of the
learning-rate schedule) and before the next: interval k holds step k's logging, evaluation and
checkpoint, and step k+1's forward, backward and optimizer step. Interval 0 is the setup. Each rank
writes its own file (`<SYNC_PROBE_OUT>.rank<N>` when there are several).
"""

import json
import os
import sys
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

# Tensor methods that copy a value to the host (on a GPU: wait for it).
SYNCING = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__")
# Frames that only forward a call: the site reported is the first frame outside them.
PASS_THROUGH = (os.path.join("torch", "_tensor.py"), os.path.join("torch", "overrides.py"), os.sep + "warnings.py",
                __file__)

events = []
state = {"interval": 0}


def is_ours(path: str) -> bool:
    """A file of this repository, not of a virtual environment kept inside it (.venv)."""
    return path.startswith(str(REPO)) and "site-packages" not in path


def library_path(path: str) -> str:
    """A library's file named from its package (deepspeed/...), wherever it is installed: site-packages, or
    a folder on PYTHONPATH (`pip install --target`, as scripts/gpu_suite.py installs)."""
    roots = [root for root in sys.path if root and path.startswith(os.path.join(root, ""))]
    return os.path.relpath(path, max(roots, key=len)) if roots else path


def site() -> dict:
    """Where the call was made (the first frame outside torch's forwarding and this file), and the
    innermost frame of this repository on the way there (what of ours led to it)."""
    frames = [f for f in traceback.extract_stack()[:-2] if not f.filename.endswith(PASS_THROUGH)]
    ours = [f for f in frames if is_ours(f.filename)]

    def name(frame):
        path = frame.filename
        path = os.path.relpath(path, REPO) if is_ours(path) else library_path(path)
        return f"{path}:{frame.lineno} ({frame.name})"

    return {"site": name(frames[-1]) if frames else "?", "via": name(ours[-1]) if ours else None}


def record(kind: str) -> None:
    events.append({"interval": state["interval"], "call": kind, **site()})


def counted(name, original):
    def wrapper(self, *args, **kwargs):
        if not state.get("inside"):  # a syncing call made by another one (format calls item) counts once
            state["inside"] = True
            try:
                record(name)
            finally:
                state["inside"] = False
        return original(self, *args, **kwargs)
    return wrapper


def count_schedule_steps():
    """The k-th optimizer step is the k-th step of the schedule (train.py, or DeepSpeed's engine, steps it)."""
    from torch.optim.lr_scheduler import LRScheduler

    original = LRScheduler.step

    def step(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        state["interval"] = max(self.last_epoch, 0)  # the constructor's initial step leaves last_epoch at 0
        return result

    LRScheduler.step = step


def report_cuda_syncs():
    """torch's sync debug mode: a warning for every synchronising CUDA operation, recorded like the rest."""
    torch.cuda.set_sync_debug_mode("warn")
    warnings.filterwarnings("always", message=".*synchroniz.*")
    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            record("cuda_sync")
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning


def main() -> None:
    out = os.environ["SYNC_PROBE_OUT"]
    for name in SYNCING:
        setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    count_schedule_steps()
    if torch.cuda.is_available():
        report_cuda_syncs()

    import train
    from textclf.cli import parse_config

    cfg, resume = train.plan_run(parse_config(sys.argv[1:]), sys.argv[1:])
    try:
        train.main(cfg, resume)
    finally:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        path = f"{out}.rank{os.environ.get('RANK', '0')}" if world > 1 else out
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"logging_steps": cfg.logging_steps, "eval_steps": cfg.eval_steps,
                       "save_steps": cfg.save_steps, "steps": state["interval"], "events": events}, f, indent=1)
    from textclf.launch.process import exit_finished_run

    exit_finished_run()


if __name__ == "__main__":
    main()
