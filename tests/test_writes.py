"""Writes into folders other users may share, and writes that fail: a symbolic link planted in place of any file
or folder a run, an export, predict or report writes is refused or replaced, never written through
(textclf/files.py); a failed write names its true cause (a full disk, out of memory, a peer's end), in one line
(docs/faults.md)."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import OFFLINE, REPO, TINY, run_train, untouched
from textclf.checkpointing.folders import checkpoint_folder
from textclf.checkpointing.write import sealed_checkpoint
from textclf.errors import PEER_ENDED, InputError, write_failed


def save_checkpoint(accelerator, output_dir: str, position: dict) -> str:
    """A checkpoint saved as train.py saves one: accelerate's save_state into the folder sealed_checkpoint yields."""
    with sealed_checkpoint(accelerator, output_dir, position) as folder:
        accelerator.save_state(folder)
    return checkpoint_folder(output_dir, position["step"])


def plant(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def test_a_link_in_place_of_the_lock_is_refused_and_its_target_left_alone(tmp_path, victim):
    from textclf.checkpointing.output_dir import refuse_if_in_use, take_lock

    out = tmp_path / "out"
    plant(out / ".lock", victim / "file")
    refuse_if_in_use(str(out))  # the probe reads no link either
    with pytest.raises(InputError) as refused:
        take_lock(str(out))
    assert str(refused.value) == (f"cannot lock {out}: {out / '.lock'} is a symbolic link (to {victim / 'file'}), and "
                                  "a run never writes through one; remove the link (or choose another folder), then "
                                  "run again")
    assert untouched(victim)


def test_run_json_and_its_temporary_file_replace_links_never_write_through_them(tmp_path, victim):
    from textclf.files import write_json

    out = tmp_path / "out"
    plant(out / "run.json", victim / "file")
    plant(out / "run.json.tmp", victim / "folder" / "file")
    write_json(str(out / "run.json"), {"config": 1})
    assert not (out / "run.json").is_symlink() and json.loads((out / "run.json").read_text()) == {"config": 1}
    assert sorted(os.listdir(out)) == ["run.json"] and untouched(victim)


def test_a_link_in_place_of_log_jsonl_is_refused_when_appending_and_when_resuming(tmp_path, victim):
    from textclf.loop.tracking import LOG, JsonLinesTracker, keep_log_until

    out = tmp_path / "out"
    plant(out / LOG, victim / "file")
    for write in (lambda: JsonLinesTracker(str(out)).log({"loss": 0.5}, step=1), lambda: keep_log_until(str(out), 2)):
        with pytest.raises(InputError, match=f"{out / LOG} is a symbolic link .* never writes through one"):
            write()
    (out / LOG).unlink()
    (out / LOG).write_text('{"step": 1}\n{"step": 3}\n')
    plant(out / f"{LOG}.tmp", victim / "file")
    keep_log_until(str(out), 2)  # its temporary file replaces the link
    assert (out / LOG).read_text() == '{"step": 1}\n' and untouched(victim)


def test_links_in_place_of_a_step_folder_and_its_temporary_folder_are_replaced(tmp_path, victim):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from textclf.checkpointing.verify import read_verified_position

    out = tmp_path / "out"
    plant(out / ".incomplete_step_2", victim / "folder")
    plant(out / "step_2", victim / "folder")
    accelerator = Accelerator(cpu=True)
    try:
        path = save_checkpoint(accelerator, str(out), {"step": 2})
    finally:
        AcceleratorState._reset_state(True)
    assert path == str(out / "step_2") and not (out / "step_2").is_symlink()
    assert read_verified_position(path)["step"] == 2 and sorted(os.listdir(out)) == ["step_2"]
    assert untouched(victim)


def test_the_exported_model_replaces_links_at_its_folder_and_its_temporary_folder(tmp_path, victim, tiny_model):
    from textclf.models.folder import load_model_folder, save_verified

    target = tmp_path / "out" / "model"
    plant(target, victim / "folder")
    plant(tmp_path / "out" / ".model.incomplete", victim / "folder")
    model, tokenizer = load_model_folder(str(tiny_model))
    save_verified(model, tokenizer, str(target), overwrite=True)
    assert not target.is_symlink() and (target / "model.safetensors").is_file()
    assert sorted(os.listdir(tmp_path / "out")) == ["model"] and untouched(victim)


def test_predict_output_and_the_report_s_files_replace_links(tmp_path, victim):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from textclf.predict import write_rows
    from textclf.report import save_figure

    out = tmp_path / "out"
    for name in ("pred.csv", "pred.csv.incomplete", "picture.png", "picture.png.incomplete.png"):
        plant(out / name, victim / "file")
    write_rows([{"text": "好", "label": "positive"}], str(out / "pred.csv"))
    save_figure(plt.figure(), str(out / "picture.png"))
    assert (out / "pred.csv").read_text(encoding="utf-8") == "text,label\n好,positive\n"
    assert (out / "picture.png").read_bytes().startswith(b"\x89PNG")
    assert sorted(os.listdir(out)) == ["picture.png", "pred.csv"]
    assert not any((out / name).is_symlink() for name in os.listdir(out)) and untouched(victim)


@pytest.mark.slow
def test_a_run_into_a_folder_with_links_planted_at_its_outputs_writes_none_of_their_targets(
        tmp_path, victim, reviews_csv, cache_dir):
    out = tmp_path / "out"
    for name in ("run.json", "run.json.tmp", "log.jsonl.tmp", "eval.jsonl", "eval.jsonl.tmp"):
        plant(out / name, victim / "file")
    for name in ("step_2", ".incomplete_step_2", "model", ".model.incomplete"):
        plant(out / name, victim / "folder")
    run_train([*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--max_steps", 2, "--save_steps", 2,
               "--output_dir", out, "--overwrite_output_dir"])
    assert untouched(victim)
    assert sorted(os.listdir(out)) == [".lock", "eval.jsonl", "log.jsonl", "model", "run.json", "step_2"]
    assert not any((out / name).is_symlink() for name in os.listdir(out))


# --- The true cause of a failed write ------------------------------------------------------------------------

TORCH_SAVE_FAILED = "[enforce fail at inline_container.cc:672] . unexpected pos 2432 vs 2330"


def test_a_failed_write_names_its_cause_full_disk_out_of_memory_or_a_peer_s_end(tmp_path, monkeypatch):
    import shutil

    from textclf import errors

    def said(error):
        return str(write_failed("save checkpoint", str(tmp_path / "step_2"), error, "the advice"))

    assert said(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))).startswith(
        f"cannot save checkpoint {tmp_path / 'step_2'}: No space left on device (")
    # torch.save's own words lose the errno: a file system left full is named full, otherwise its words stay.
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(errors.shutil, "disk_usage", lambda path: usage._replace(free=4096))
    assert said(RuntimeError(TORCH_SAVE_FAILED)).startswith(
        f"cannot save checkpoint {tmp_path / 'step_2'}: No space left on device (0.0 MiB free on its file system")
    monkeypatch.setattr(errors.shutil, "disk_usage", lambda path: usage._replace(free=10 * 2 ** 30))
    assert ": [enforce fail at inline_container.cc:672] . unexpected pos" in said(RuntimeError(TORCH_SAVE_FAILED))
    # Out of memory (CUDA's, while ZeRO-3 gathers the weights to save them) is not a full disk.
    oom = said(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)"))
    assert oom.startswith(f"cannot save checkpoint {tmp_path / 'step_2'}: out of memory (CUDA out of memory); "
                          "the disk is not the cause: free memory") and "free on its file system" not in oom
    # A collective whose peer ended, under a launch.
    monkeypatch.setenv("WORLD_SIZE", "2")
    peer = said(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                             "[127.0.0.1]:29500"))
    assert peer.startswith(f"cannot save checkpoint {tmp_path / 'step_2'}: {PEER_ENDED} (Connection closed by peer")
    assert "free on its file system" not in peer
    # Any other RuntimeError is no failed write: it keeps its own traceback.
    bug = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    assert write_failed("save checkpoint", str(tmp_path), bug, "the advice") is bug


def test_torch_save_on_a_full_disk_is_named_full_not_unexpected_pos(tmp_path):
    """A real torch.save that runs out of room: on a tmpfs of 1 MiB where root may mount one (the disk is then
    full), else under a file size limit (ulimit -f)."""
    from test_faults import full_disk

    saving = ("import sys, torch\n"
              "from textclf.errors import run_command, write_failed\n"
              "def save():\n"
              "    try:\n"
              "        torch.save(torch.zeros(2 ** 20), sys.argv[1])\n"
              "    except RuntimeError as e:\n"
              "        raise write_failed('save checkpoint', sys.argv[1], e, 'free space') from None\n"
              "run_command(save)\n")
    with full_disk(tmp_path / "disk", 2 ** 20 // 2) as (out, limit):
        result = subprocess.run([sys.executable, "-c", saving, str(out / "weights.pt")], cwd=REPO, capture_output=True,
                                text=True, env={**os.environ, **OFFLINE}, preexec_fn=limit, timeout=300)
        reason = "File too large" if limit else "No space left on device"
        assert result.returncode == 2 and result.stderr.startswith(
            f"error: cannot save checkpoint {out / 'weights.pt'}: {reason} ("), result.stderr
        assert len(result.stderr.splitlines()) == 1 and "unexpected pos" not in result.stderr


def test_out_of_memory_while_saving_a_checkpoint_is_named_as_such_and_leaves_nothing(tmp_path, monkeypatch):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState


    accelerator = Accelerator(cpu=True)

    def gather_runs_out(folder):  # as ZeRO-3's gather of the 16-bit weights does on a GPU that is full
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(accelerator, "save_state", gather_runs_out)
    try:
        with pytest.raises(InputError) as refused:
            save_checkpoint(accelerator, str(tmp_path), {"step": 2})
    finally:
        AcceleratorState._reset_state(True)
    assert str(refused.value).startswith(f"cannot save checkpoint {tmp_path / 'step_2'}: out of memory (CUDA out of "
                                         "memory); the disk is not the cause")
    assert os.listdir(tmp_path) == []
