"""The error path (textclf/errors.py): one error: line, a peer's end told apart from a failed write, a rank stopped
quietly."""

import errno
import os
import resource
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import OFFLINE, REPO, free_port, full_disk
from textclf.checkpointing.folders import checkpoint_folder
from textclf.checkpointing.write import sealed_checkpoint
from textclf.errors import PEER_ENDED, InputError, peer_ended, run_command, write_failed


def save_checkpoint(accelerator, output_dir: str, position: dict) -> str:
    """A checkpoint saved as train.py saves one: accelerate's save_state into the folder sealed_checkpoint yields."""
    with sealed_checkpoint(accelerator, output_dir, position) as folder:
        accelerator.save_state(folder)
    return checkpoint_folder(output_dir, position["step"])


@pytest.fixture
def peer_gone(monkeypatch):
    """The RuntimeError a real gloo collective raises on rank 0 of a 2-process group whose rank 1 has ended."""
    import torch.distributed as dist

    port = str(free_port())
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    peer = subprocess.Popen(
        [sys.executable, "-c", "import os, torch.distributed as d; d.init_process_group('gloo'); os._exit(0)"],
        env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": "1", "WORLD_SIZE": "2"})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    try:
        peer.wait(timeout=120)
        with pytest.raises(RuntimeError) as failed:
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return failed.value


TORCH_SAVE_FAILED = "[enforce fail at inline_container.cc:672] . unexpected pos 2432 vs 2330"


def test_a_collective_whose_peer_ended_is_told_apart_from_a_failed_write(peer_gone, tmp_path):
    assert peer_ended(peer_gone)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 ** 20, limit[1]))  # no file beyond 1 MiB, as on a full disk
    try:
        with pytest.raises(RuntimeError) as torch_save_failed:  # what torch.save raises then: no errno
            torch.save({"weights": torch.zeros(1_000_000)}, tmp_path / "weights.pt")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    assert not peer_ended(torch_save_failed.value)
    assert not peer_ended(OSError(28, "No space left on device"))


def test_a_save_that_fails_because_a_rank_died_does_not_blame_the_disk(peer_gone, tmp_path):
    def save_state(folder):
        os.makedirs(folder, exist_ok=True)  # as accelerate's save_state makes it
        raise peer_gone  # as DeepSpeed's collective save raises it on rank 0

    accelerator = SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None, save_state=save_state)
    with pytest.raises(InputError) as refused:
        save_checkpoint(accelerator, str(tmp_path), {"step": 2})
    message = str(refused.value)
    assert message.startswith(f"cannot save checkpoint {tmp_path / 'step_2'}: {PEER_ENDED} (Connection closed by "
                              "peer")
    assert "free space" not in message and "MiB free" not in message and len(message.splitlines()) == 1
    assert os.listdir(tmp_path) == []


def test_a_rank_whose_collective_failed_after_another_ended_says_one_line(peer_gone, monkeypatch, capsys):
    def died(code):
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", died)  # run_command ends a multi-process rank without interpreter teardown

    def main():
        raise peer_gone

    with pytest.raises(SystemExit) as ended:
        run_command(main)
    assert ended.value.code == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [f"error: {PEER_ENDED} (Connection closed by peer "
                                + err.split("(Connection closed by peer ")[1].splitlines()[0]]
    assert "Traceback" not in err


def test_a_rank_the_launcher_stopped_during_the_failed_collective_ends_quietly_on_that_signal():
    """Once rank 0 has failed, the launcher sends the other ranks SIGTERM. One that was waiting in a collective
    meanwhile hands the signal to train.py's handler (a checkpoint at the next logging step), then meets the
    collective's failure: it must still end on that SIGTERM, silently, not report the failure after waiting."""
    rank_1 = subprocess.run(
        [sys.executable, "-c", "from textclf import errors\nerrors.stop_signals.append('SIGTERM')\n"
                               "errors.report(errors.InputError(errors.PEER_ENDED))"],
        env={**os.environ, "RANK": "1", "WORLD_SIZE": "2"}, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert rank_1.returncode == -15 and rank_1.stderr == "", rank_1.stderr


def test_an_error_closes_an_open_progress_bar_first(capsys):
    """errors.report closes the bars tqdm lists in its private _instances, so the error starts a line of its own."""
    import io

    from tqdm import tqdm

    from textclf.errors import report

    bar = tqdm(total=10, file=io.StringIO())
    bar.update(3)
    assert bar in tqdm._instances
    report(InputError("bad input"))
    assert bar.disable and bar not in getattr(tqdm, "_instances", ())  # closed
    assert capsys.readouterr().err == "error: bad input\n"


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
