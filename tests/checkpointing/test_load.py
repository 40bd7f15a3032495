"""A resume loaded (textclf/checkpointing/load.py): bitwise on one process and several, after kills and signals, under
every strategy and on another number of processes; its position checked against the schedule and against the
checkpoint's own scheduler and optimizer; what accelerate's load does not put back as an uninterrupted run has it."""

import fcntl
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import time
import types

import psutil
import pytest
import torch

from conftest import (
    CPU_YAML,
    OFFLINE,
    REPO,
    TINY,
    RunsCode,
    assert_same_run,
    losses,
    read_csv,
    read_log,
    reseal,
    run_train,
    step_moved,
    train_command,
    train_forked,
    wait_for,
    weights,
)
from textclf.checkpointing.load import refuse_other_counts
from textclf.checkpointing.write import (
    SIGNATURE,
    SIGNED_FORMAT,
    own_secret,
    sealed,
)
from textclf.errors import InputError

SCHEDULE = {"total_steps": 20, "steps_per_epoch": 5, "batches_per_epoch": 14, "gradient_accumulation_steps": 3,
            "world_size": 2}


WINDOWS = [{"loss_sum": 0.0, "losses": 0, "samples": 0, "real_tokens": 0, "padded_tokens": 0}] * 2


BAD_POSITIONS = {
    "string step": ({"step": "6"}, ['step is "6", expected a whole number >= 0']),
    "fractional step": ({"step": 6.5}, ["step is 6.5"]),
    "negative epoch": ({"epoch": -1}, ["epoch is -1"]),
    "boolean batch": ({"batch_in_epoch": True}, ["batch_in_epoch is true"]),
    "step past the end": ({"step": 26, "epoch": 5, "batch_in_epoch": 3}, ["past the end of this run at step 20"]),
    "batch past the epoch": ({"batch_in_epoch": 15}, ["outside this run's epoch of 14 batches"]),
    "epoch that the step is not in": ({"epoch": 2}, ["step 6 is not where epoch 2, batch 3"]),
    "window of one rank": ({"loss_window": WINDOWS[:1]}, ["loss_window is not one loss window"]),
    "two violations": ({"step": "6", "loss_window": None}, ["step is", "loss_window is not"]),
}


def train(args, config_file=None, check=True):
    """train.py forked after the imports (conftest.train_forked): one process, or the ranks `config_file` sets up.
    The launches these resumes are made from are real where a test stops them, and `python train.py --resume`
    runs for real in test_a_non_default_run_resumes_exactly_from_its_path_alone."""
    return train_forked(args, config_file=config_file, check=check)


@pytest.fixture(scope="module")
def args(reviews_csv, cache_dir):
    # 216 training examples, micro-batches of 8.
    return [*TINY, "--data", reviews_csv, "--cache_dir", cache_dir]


@pytest.fixture(scope="module")
def two_process_ga3(tmp_path_factory, args):
    """2 processes, GA 3: 4 global batches of 48 per epoch (24 of the 216 examples sit out), so 12
    micro-batches per process and 4 optimizer steps per epoch.

    Checkpoints at every step give both an epoch boundary (step 4) and mid-epoch points; the eval
    set (24) is not a multiple of its batch (7), and an evaluation (every 3 steps) precedes some. A
    log line every 5 steps: the checkpoints at steps 6 and 7 fall between two.
    """
    out = tmp_path_factory.mktemp("ga3")
    run = [*args, "--gradient_accumulation_steps", 3, "--max_steps", 12, "--eval_steps", 3,
           "--per_device_eval_batch_size", 7, "--logging_steps", 5]
    train([*run, "--save_steps", 1, "--output_dir", out], config_file=CPU_YAML)
    return out, run


def start(args, output_dir):
    return subprocess.Popen(train_command([*args, "--output_dir", output_dir], CPU_YAML), cwd=REPO,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **OFFLINE}, text=True)


@pytest.fixture(scope="module")
def kill_run(tmp_path_factory, args):
    """30 steps over 2+ epochs, a checkpoint every 3: the uninterrupted reference."""
    run = [*args, "--max_steps", 30, "--save_steps", 3, "--eval_steps", 9]
    out = tmp_path_factory.mktemp("uninterrupted")
    train([*run, "--output_dir", out], config_file=CPU_YAML)
    return out, run


def first_checkpoint_exists(out):
    return lambda: (out / "step_3" / "position.json").exists()


def start_until_a_checkpoint(run, out):
    """A 2-process run started into `out`, once its first checkpoint is complete (so a kill leaves one)."""
    process = start(run, out)
    wait_for(first_checkpoint_exists(out), process)
    return process


def saving(out):
    return lambda: any(name.startswith(".incomplete_step_") for name in os.listdir(out)) if out.exists() else False


def kill(process, out):
    """SIGKILL to the launcher's group, which does not hold the ranks (torchrun starts each in a session of
    its own): they die with their launcher all the same (errors.die_with_launcher), or they would train
    on into the folder that the next run resumes from. Then wait, as a user would be told to, until the
    killed run has let go of `out`: a rank's main thread shows as a zombie while its other threads are
    still ending, and the lock is released with the last of them."""
    ranks = psutil.Process(process.pid).children(recursive=True)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    wait_for(lambda: not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], None, 120)
    wait_for(lambda: lock_is_free(out), None, 120)


def lock_is_free(out) -> bool:
    with open(out / ".lock") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(lock, fcntl.LOCK_UN)
        return True


@pytest.fixture(scope="module")
def checkpoint_run(four_step_run):
    return four_step_run


def corrupt_copy(source, target, edit):
    shutil.copytree(source, target)
    edit(target)
    return target


def truncate(name):
    def edit(folder):
        (folder / name).write_bytes((folder / name).read_bytes()[:100])
    return edit


def delete(name):
    return lambda folder: (folder / name).unlink()


def set_position(**changes):
    """Edit position.json and sign it again with this user's secret, as a run that wrote those values would have: what
    refuses it is then the check after the signature's (checkpointing/test_verify.py shows an edit that is not signed
    refused)."""

    def edit(folder):
        position = json.loads((folder / "position.json").read_text())
        (folder / "position.json").write_text(json.dumps(sealed({**position, **changes}, own_secret())))
    return edit


def record_files(folder):
    """Make position.json's list of files agree with what is there, as someone editing the checkpoint would, who has
    not this user's secret: the signature goes (a checkpoint from elsewhere), the sha256 is made again, and what
    refuses the checkpoint is then the check after the signature's."""
    from textclf.checkpointing.write import manifest

    position = json.loads((folder / "position.json").read_text())
    unsigned = {key: value for key, value in position.items() if key not in (SIGNATURE, *SIGNED_FORMAT)}
    (folder / "position.json").write_text(json.dumps(sealed({**unsigned, "files": manifest(str(folder))})))


def unreadable_rng_state(folder):
    (folder / "random_states_0.pkl").write_bytes(b"not a pickle at all")
    record_files(folder)


BAD_RESUMES = {
    "path that does not exist": (lambda src, tmp: tmp / "nowhere", [], "checkpoint not found"),
    "folder that is not a checkpoint": (lambda src, tmp: tmp, [], "is not a complete checkpoint"),
    "truncated optimizer": (lambda src, tmp: corrupt_copy(src, tmp / "c", truncate("optimizer.bin")), [],
                            "optimizer.bin has 100 bytes, "),
    "missing RNG state": (lambda src, tmp: corrupt_copy(src, tmp / "c", delete("random_states_0.pkl")), [],
                          "random_states_0.pkl is missing"),
    "truncated RNG state": (lambda src, tmp: corrupt_copy(src, tmp / "c", truncate("random_states_0.pkl")), [],
                            "random_states_0.pkl has 100 bytes"),
    # Rank 0's RNG state of the run's next checkpoint: the same size, another state.
    "foreign RNG state": (lambda src, tmp: corrupt_copy(src, tmp / "c", lambda folder: shutil.copy(
        src.parent / "step_4" / "random_states_0.pkl", folder)), [],
        "random_states_0.pkl is not the file that was saved (its sha256 differs)"),
    "RNG state that does not load": (lambda src, tmp: corrupt_copy(src, tmp / "c", unreadable_rng_state), [],
                                     "random_states_0.pkl does not load as rank 0's RNG state"),
    "missing scheduler state": (lambda src, tmp: corrupt_copy(src, tmp / "c", delete("scheduler.bin")), [],
                                "scheduler.bin is missing"),
    "files not recorded": (lambda src, tmp: corrupt_copy(src, tmp / "c", set_position(files=None)), [],
                           "lists no files to check it against"),
    "RNG state left out of the record": (
        lambda src, tmp: corrupt_copy(src, tmp / "c", lambda f: (delete("random_states_0.pkl")(f), record_files(f))),
        [], "random_states_0.pkl is not among the files it recorded"),
    "string step": (lambda src, tmp: corrupt_copy(src, tmp / "c", set_position(step="2")), [],
                    'position.json: step is "2", expected a whole number >= 0'),
    "position.json edited by hand": (lambda src, tmp: corrupt_copy(src, tmp / "c", lambda folder: (
        folder / "position.json").write_text((folder / "position.json").read_text().replace('"step": 2', '"step": 3'))),
        [], "position.json is not the file that was saved (its sha256 differs)"),
    "unlisted custom state": (lambda src, tmp: corrupt_copy(src, tmp / "c", lambda folder: shutil.copy(
        folder / "random_states_0.pkl", folder / "custom_checkpoint_0.pkl")), [],
        "custom_checkpoint_0.pkl is not among the files it recorded (accelerate would load it as the state of an "
        "object this run does not register); remove it"),
    "step past the end": (lambda src, tmp: src, ["--max_steps", "1"], "step is 2, past the end of this run at step 1"),
    "flags that conflict with it": (lambda src, tmp: src, ["--model", "scratch-mini", "--per_device_train_batch_size",
                                                           "4"], "it was made with model = scratch-tiny"),
    "another model": (lambda src, tmp: src, ["--model", "scratch-mini"], "made with model = scratch-tiny"),
    "other data": (lambda src, tmp: corrupt_copy(src, tmp / "c", set_position(data_fingerprint="0" * 16)), [],
                   "made with training data = 0000000000000000"),
    "changed accumulation": (lambda src, tmp: src, ["--gradient_accumulation_steps", "2"],
                             "made with gradient_accumulation_steps = 1, this run has 2"),
    "changed strategy": (lambda src, tmp: corrupt_copy(src, tmp / "c", set_position(zero_stage=2)), [],
                         "made by a launch with DeepSpeed ZeRO stage 2 (this launch: None); resume it with "
                         "accelerate launch --config_file accelerate_configs/zero2.yaml"),
    # as a launch under ddp_bf16.yaml would set it, where the config's own field stays unset
    "changed precision": (lambda src, tmp: corrupt_copy(src, tmp / "c", set_position(mixed_precision="bf16")), [],
                          "made by a launch with precision (mixed_precision) bf16 (this launch: no); resume it "
                          "with python train.py --mixed_precision bf16 --resume"),
}


@pytest.fixture(scope="module")
def gbk_tsv(tmp_path_factory, reviews_csv):
    """The 240 reviews as a GBK-encoded TSV with the columns named sentiment and comment."""

    path = tmp_path_factory.mktemp("gbk") / "reviews.tsv"
    lines = ["sentiment\tcomment"] + [f"{row['label']}\t{row['review']}" for row in read_csv(reviews_csv)]
    path.write_bytes(("\n".join(lines) + "\n").encode("gbk"))
    return path


def assert_close_run(uninterrupted, resumed, from_step, rel=1e-4):
    """The resumed steps log the uninterrupted run's losses within float summation error (the micro-batches, their
    dropout masks and the global batch are the same; only the order of the sums differs)."""
    expected, got = losses(uninterrupted), losses(resumed)
    later = [step for step in expected if step > from_step]
    assert later and all(step in got for step in later), f"resumed run logged {sorted(got)}"
    far = [(step, expected[step], got[step]) for step in later
           if abs(got[step] - expected[step]) > rel * abs(expected[step])]
    assert not far, f"losses differ after resume by more than {rel} (step, uninterrupted, resumed): {far[:5]}"
    reference, final = weights(uninterrupted), weights(resumed)
    assert all((reference[name] - final[name]).abs().max() <= 1e-4 for name in reference), "final weights differ"


# (processes, accumulation) of the run that made the checkpoint, and the processes that resume it
RESHAPES = {"2-to-1": ((2, 1), 1), "1-to-2": ((1, 2), 2)}


def on(zoo_file, processes):
    """train_forked's launch of `processes` ranks with a zoo file; one process of cpu.yaml is `python train.py`."""
    if zoo_file == "cpu.yaml" and processes == 1:
        return dict(config_file=None)
    return dict(config_file=REPO / "accelerate_configs" / zoo_file, num_processes=processes)


@pytest.fixture(scope="module")
def dropout_free_model(tmp_path_factory, tiny_model):
    """tiny_model without dropout: the masks of micro-batches of another size are all that would tell apart two
    runs whose global batches split into micro-batches differently."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    from textclf.models.folder import save_verified

    model = BertForSequenceClassification.from_pretrained(tiny_model, hidden_dropout_prob=0.0,
                                                          attention_probs_dropout_prob=0.0)
    return save_verified(model, AutoTokenizer.from_pretrained(tiny_model),
                         str(tmp_path_factory.mktemp("dropout_free") / "model"))


@pytest.mark.parametrize("case", BAD_POSITIONS)
def test_a_position_outside_the_schedule_is_one_line_per_violation(case):
    from textclf.checkpointing.load import check_position
    from textclf.errors import InputError

    changes, messages = BAD_POSITIONS[case]
    position = {"step": 6, "epoch": 1, "batch_in_epoch": 3, "loss_window": WINDOWS, **changes}
    with pytest.raises(InputError) as refused:
        check_position("ckpt", position, **SCHEDULE)
    lines = str(refused.value).splitlines()
    assert len(lines) == len(messages) and all(m in line for m, line in zip(messages, lines)), lines
    check_position("ckpt", {"step": 6, "epoch": 1, "batch_in_epoch": 3, "loss_window": WINDOWS}, **SCHEDULE)
    check_position("ckpt", {"step": 5, "epoch": 0, "batch_in_epoch": 14, "loss_window": WINDOWS}, **SCHEDULE)


@pytest.mark.slow
def test_a_finished_run_is_checkpointed_at_its_end_and_resuming_it_says_so(tmp_path, args):
    """As the Trainer does, the last step is saved whatever --save_steps: `--resume latest` (or a requeued job's
    `--resume auto`) on a finished run trains nothing, and a fresh start into its folder is refused."""
    out = tmp_path / "run"
    run = [*args, "--max_steps", 3, "--save_steps", 2, "--output_dir", out]
    train(run)
    assert sorted(path.name for path in out.glob("step_*")) == ["step_2", "step_3"]
    finished = weights(out)
    for resume in ("latest", "auto"):
        again = train([*run, "--resume", resume])
        assert (f"{out / 'step_3'} is the end of this run (step 3): nothing left to train; evaluating and exporting "
                "it again. To train longer, pass a larger --max_steps or --num_train_epochs") in again.stdout
        assert max(losses(out)) == 3 and all(weights(out)[name].equal(finished[name]) for name in finished)
    fresh = train(run, check=False)
    assert fresh.returncode == 2 and f"{out} already holds checkpoints (newest {out / 'step_3'})" in fresh.stderr


@pytest.mark.slow
@pytest.mark.parametrize("logging_steps", [1, 5])
def test_one_process_resume_is_bitwise_exact(tmp_path, args, logging_steps):
    run = [*args, "--max_steps", 30, "--save_steps", 7, "--logging_steps", logging_steps]
    train([*run, "--output_dir", tmp_path / "full"])
    train([*run, "--output_dir", tmp_path / "resumed", "--resume", tmp_path / "full" / "step_14"])
    assert_same_run(tmp_path / "full", tmp_path / "resumed", 14)
    window = json.loads((tmp_path / "full" / "step_14" / "position.json").read_text())["loss_window"]
    assert [w["losses"] for w in window] == [14 % logging_steps]  # micro-batches since the last log line


@pytest.mark.slow
@pytest.mark.parametrize("step", [4, 6, 7], ids=["epoch-boundary", "after-mid-epoch-eval", "mid-epoch"])
def test_two_processes_with_accumulation_resume_exactly(tmp_path, two_process_ga3, step):
    full, run = two_process_ga3
    position = json.loads((full / f"step_{step}" / "position.json").read_text())
    assert (position["epoch"], position["batch_in_epoch"]) == {4: (0, 12), 6: (1, 6), 7: (1, 9)}[step]
    train([*run, "--output_dir", tmp_path, "--resume", full / f"step_{step}"], config_file=CPU_YAML)
    assert_same_run(full, tmp_path, step)
    evals = [row for row in read_log(tmp_path) if "eval_accuracy" in row]
    assert evals and all(row["eval_samples"] == 24 for row in evals)


@pytest.mark.slow
def test_length_grouping_off_resumes_exactly_too(tmp_path, args):
    run = [*args, "--no_group_by_length", "--max_steps", 20, "--save_steps", 10]
    train([*run, "--output_dir", tmp_path / "full"], config_file=CPU_YAML)
    train([*run, "--output_dir", tmp_path / "resumed", "--resume", tmp_path / "full" / "step_10"],
              config_file=CPU_YAML)
    assert_same_run(tmp_path / "full", tmp_path / "resumed", 10)


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["after-first-checkpoint", "random-later"])
def test_sigkill_at_any_moment_then_resume_latest_finishes_the_same_run(tmp_path, kill_run, moment):
    full, run = kill_run
    out = tmp_path / "killed"
    process = start_until_a_checkpoint(run, out)
    if moment == "random-later":
        time.sleep(random.Random(os.getpid()).uniform(0.5, 4.0))
    kill(process, out)
    train([*run, "--output_dir", out, "--resume", "latest"], config_file=CPU_YAML)
    assert_same_run(full, out, 0)


@pytest.mark.slow
def test_sigkill_during_a_save_leaves_the_previous_checkpoint_to_resume_from(tmp_path, kill_run):
    full, run = kill_run
    out = tmp_path / "killed"
    process = start_until_a_checkpoint(run, out)
    for attempt in range(5):  # a save takes milliseconds: a kill may land just after one; try again
        wait_for(saving(out), process)
        kill(process, out)
        if saving(out)():
            break
        process = start([*run, "--resume", "latest"], out)
    assert saving(out)(), "no kill landed inside a save in 5 attempts"
    train([*run, "--output_dir", out, "--resume", "latest"], config_file=CPU_YAML)
    assert_same_run(full, out, 0)


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_every_rank_with_a_checkpoint_and_exit_0(tmp_path, kill_run):
    full, run = kill_run
    out = tmp_path / "preempted"
    process = start_until_a_checkpoint(run, out)
    workers = [p for p in psutil.Process(process.pid).children(recursive=True) if "train.py" in " ".join(p.cmdline())]
    rank_1 = next(p for p in workers if p.environ().get("RANK") == "1")
    rank_1.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]
    last = max(losses(out))
    assert f"stopped by a signal to another rank at step {last}; continue with: --resume {out / f'step_{last}'}" \
        in stdout
    assert (out / f"step_{last}" / "position.json").exists() and last < 30
    assert not (out / "model").exists()
    train([*run, "--output_dir", tmp_path / "resumed", "--resume", out / f"step_{last}"], config_file=CPU_YAML)
    assert_same_run(full, tmp_path / "resumed", last)


@pytest.mark.slow
def test_rotation_keeps_the_newest_and_the_best_and_resume_from_the_best_works(tmp_path, args):
    out = tmp_path / "rotated"
    run = [*args, "--max_steps", 12, "--save_steps", 2, "--eval_steps", 2, "--save_total_limit", 2,
           "--metric_for_best_model", "eval_accuracy"]
    train([*run, "--output_dir", out])
    evals = {row["step"]: row["eval_accuracy"] for row in read_log(out) if "eval_accuracy" in row}
    assert sorted(evals) == [2, 4, 6, 8, 10, 12]
    best = max(evals, key=lambda step: (evals[step], step))  # ties go to the newer checkpoint
    kept = sorted(int(name.split("_")[1]) for name in os.listdir(out) if name.startswith("step_"))
    assert kept == sorted({10, 12, best})
    train([*run, "--max_steps", 14, "--output_dir", tmp_path / "from-best", "--resume", out / f"step_{best}"])


@pytest.mark.slow
@pytest.mark.parametrize("case", BAD_RESUMES)
def test_bad_resume_is_one_clear_line_and_trains_nothing(case, tmp_path, args, checkpoint_run):
    make_checkpoint, extra, message = BAD_RESUMES[case]
    out = tmp_path / "out"
    checkpoint = make_checkpoint(checkpoint_run / "step_2", tmp_path)
    result = train([*args, "--max_steps", 4, "--output_dir", out, "--resume", checkpoint, *extra], check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-3000:]
    assert not out.exists()


@pytest.mark.slow
def test_resume_latest_without_checkpoints_says_so_and_trains_nothing(tmp_path, args):
    result = train([*args, "--output_dir", tmp_path / "empty", "--resume", "latest"], check=False)
    assert result.returncode == 2
    assert "--resume latest: no complete checkpoint in" in result.stderr
    assert "drop --resume to start a fresh run" in result.stderr


@pytest.mark.slow
def test_a_fresh_run_refuses_a_folder_that_holds_checkpoints(args, checkpoint_run):
    result = train([*args, "--max_steps", 4, "--output_dir", checkpoint_run], check=False)
    assert result.returncode == 2
    assert "already holds checkpoints" in result.stderr and "--resume latest" in result.stderr


@pytest.mark.slow
def test_a_pickle_that_runs_code_is_refused_not_run(tmp_path, args, checkpoint_run):
    marker = tmp_path / "code-ran"
    checkpoint = shutil.copytree(checkpoint_run / "step_2", tmp_path / "poisoned")
    for name in ("random_states_0.pkl", "optimizer.bin"):
        with open(checkpoint / name, "wb") as f:
            pickle.dump(RunsCode(str(marker)), f)
    record_files(checkpoint)  # as an attacker would: what is refused then is the unpickling itself
    result = train([*args, "--max_steps", 4, "--output_dir", tmp_path / "out", "--resume", checkpoint],
                       check=False)
    assert result.returncode == 2 and "random_states_0.pkl does not load as rank 0's RNG state" in result.stderr
    assert not marker.exists()
    (checkpoint / "random_states_0.pkl").write_bytes((checkpoint_run / "step_2" / "random_states_0.pkl").read_bytes())
    record_files(checkpoint)
    result = train([*args, "--max_steps", 4, "--output_dir", tmp_path / "out", "--resume", checkpoint],
                       check=False)
    assert result.returncode == 2 and "cannot load checkpoint" in result.stderr
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("zoo_file, launch", [("zero2.yaml", run_train), ("zero3.yaml", train), ("cpu.yaml", train)],
                         ids=["zero2 (accelerate launch)", "zero3", "cpu"])
def test_the_card_s_two_commands_resume_exactly_with_no_other_flag(tmp_path, args, zoo_file, launch):
    """`accelerate launch --config_file <zoo file> train.py`, then the same launch with `--resume <dir>/step_3`: the
    run's own checkpoint proves it wrote it (signed), DeepSpeed's pickles are read weights-only, and the resumed
    steps log the uninterrupted run's losses bitwise. zero2 under the real launcher, the others forked. DeepSpeed's
    own layout is checked too: each rank's optimizer partition, under the tag folder, is among what a resume
    requires."""
    config = REPO / "accelerate_configs" / zoo_file
    run = [*args, "--max_steps", 6, "--save_steps", 3, "--eval_steps", 2]
    launch([*run, "--output_dir", tmp_path / "full"], config_file=config)
    resumed = launch([*run, "--output_dir", tmp_path / "resumed", "--resume", tmp_path / "full" / "step_3"],
                     config_file=config)
    assert "warning:" not in resumed.stderr, resumed.stderr[-3000:]
    assert_same_run(tmp_path / "full", tmp_path / "resumed", 3)
    if zoo_file == "cpu.yaml":
        return
    damaged = shutil.copytree(tmp_path / "full" / "step_3", tmp_path / "damaged")
    partition = "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    (damaged / partition).unlink()
    refused = train([*run, "--output_dir", tmp_path / "refused", "--resume", damaged], config_file=config,
                    check=False)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: cannot resume from {damaged}: {partition} is missing; resume from another checkpoint "
                      "(--resume <output_dir>/step_<N>)"], refused.stderr[-3000:]
    assert not (tmp_path / "refused").exists()


def test_after_a_load_the_schedule_sets_the_learning_rate_of_the_optimizer_that_steps():
    """As accelerate builds DeepSpeed's CPU Adam for offload_optimizer: a second optimizer on the param group dicts
    of the one the schedule was built on. Loading a state dict gives it new dicts; pointed at it again, the schedule
    sets the rate it steps with, and only then."""
    import torch

    from textclf.checkpointing.load import schedule_the_optimizer_that_steps

    def build():
        weight = torch.nn.Parameter(torch.zeros(4))
        built = torch.optim.AdamW([weight], lr=1.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(built, lambda step: 1 / (step + 1))
        return built, schedule, torch.optim.AdamW(built.param_groups)  # the second shares the group dicts

    saved = build()[2].state_dict()
    for pointed in (False, True):
        _, schedule, stepping = build()
        stepping.load_state_dict(saved)
        wrapped = types.SimpleNamespace(scheduler=schedule)  # accelerate's AcceleratedScheduler
        if pointed:
            schedule_the_optimizer_that_steps(wrapped, types.SimpleNamespace(optimizer=stepping))
        schedule.step()
        assert (stepping.param_groups[0]["lr"] == 0.5) == pointed


@pytest.mark.slow
@pytest.mark.parametrize("zoo_file", ["zero2_offload.yaml", "zero3_offload.yaml"])
def test_an_offloaded_optimizer_resumes_exactly_on_its_schedule(tmp_path, args, zoo_file):
    """DeepSpeed's CPU Adam, which accelerate swaps in for train.py's AdamW: after a load the schedule still sets
    the learning rate it steps with (checkpointing/load.py's schedule_the_optimizer_that_steps; without it the
    run went on at the checkpoint's rate, and losses parted from the second resumed update on), and its bias
    corrections follow the uninterrupted run's running product (checkpointing/load.py's replay_cpu_adam_steps)."""
    config = REPO / "accelerate_configs" / zoo_file
    run = [*args, "--max_steps", 8, "--save_steps", 4, "--eval_strategy", "no"]
    train([*run, "--output_dir", tmp_path / "full"], config_file=config)
    train([*run, "--output_dir", tmp_path / "resumed", "--resume", tmp_path / "full" / "step_4"], config_file=config)
    assert_same_run(tmp_path / "full", tmp_path / "resumed", 4)


@pytest.mark.slow
def test_sigterm_then_the_same_command_again_finishes_the_uninterrupted_run(tmp_path, args):
    """What a requeued SLURM job does (scripts/slurm.sbatch): one command, run until a SIGTERM stops it with a
    checkpoint, then run again, continues where it stopped and ends with the uninterrupted run's weights."""
    run = [*args, "--max_steps", 30, "--save_steps", 10, "--output_dir", tmp_path / "requeued", "--resume", "auto"]
    train([*args, "--max_steps", 30, "--save_steps", 10, "--output_dir", tmp_path / "full"])
    process = subprocess.Popen(train_command(run), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, **OFFLINE}, text=True)
    wait_for(lambda: (tmp_path / "requeued" / "log.jsonl").exists()
             and len(losses(tmp_path / "requeued")) >= 3, process)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]
    stopped_at = max(losses(tmp_path / "requeued"))
    assert f"stopped by SIGTERM at step {stopped_at}" in stdout and stopped_at < 30
    assert not (tmp_path / "requeued" / "model").exists()
    again = train(run)
    assert f"resumed from {tmp_path / 'requeued' / f'step_{stopped_at}'}" in again.stdout
    assert_same_run(tmp_path / "full", tmp_path / "requeued", 0)


@pytest.mark.slow
def test_a_non_default_run_resumes_exactly_from_its_path_alone(tmp_path, gbk_tsv, cache_dir):
    """Micro-batch, accumulation, lr, warmup steps, max_length, column names, a GBK TSV, logging every step and
    the best model kept: `python train.py --resume <checkpoint>` with nothing else replays the same run."""
    full = tmp_path / "full"
    first = run_train(["--data", gbk_tsv, "--text_column", "comment", "--label_column", "sentiment",
                       "--per_device_train_batch_size", 6, "--gradient_accumulation_steps", 2, "--learning_rate", 0.002,
                       "--warmup_steps", 3, "--max_length", 24, "--logging_steps", 1, "--max_steps", 20,
                       "--eval_steps", 8, "--save_steps", 8, "--load_best_model_at_end", "--report_to", "none",
                       "--cache_dir", cache_dir, "--output_dir", full])
    assert f"note: {gbk_tsv} is not UTF-8" in first.stdout and "reading it as GB18030" in first.stdout
    resumed = tmp_path / "resumed"
    shutil.copytree(full / "step_8", resumed / "step_8")  # mid-epoch: 18 optimizer steps per epoch
    for folder in full.glob("step_*"):  # the best is found where the run goes on, not where it began
        shutil.rmtree(folder)
    run_train(["--resume", resumed / "step_8"])
    assert_same_run(full, resumed, 8)
    made, again = (json.loads((out / "run.json").read_text()) for out in (full, resumed))
    assert again["config"] == {**made["config"], "output_dir": str(resumed), "resume": str(resumed / "step_8")}
    assert made["best_model"]["step"] in (8, 16, 20)
    assert again["best_model"] == {**made["best_model"], "checkpoint": made["best_model"]["checkpoint"] and
                                   str(resumed / f"step_{made['best_model']['step']}")}
    lrs = [row["lr"] for row in read_log(full) if "lr" in row]
    assert lrs[:3] == pytest.approx([0.002 / 3, 2 * 0.002 / 3, 0.002])  # 3 warmup steps, not a ratio of 20


@pytest.mark.slow
@pytest.mark.parametrize("zoo_file", ["cpu.yaml", "zero2.yaml", "zero3.yaml"])
@pytest.mark.parametrize("reshape", RESHAPES)
def test_a_checkpoint_resumes_on_another_number_of_processes_keeping_the_global_batch(tmp_path, args, reshape,
                                                                                     zoo_file):
    """DDP and one process load their whole states; ZeRO's partitions go through DeepSpeed's universal checkpoint
    (the default model, its dropout on)."""
    (made_on, accumulation), resumed_on = RESHAPES[reshape]
    # From an odd step: on fewer processes the micro-batch counter accelerate restores would sync out of phase.
    run = [*args, "--max_steps", 10, "--save_steps", 5, "--logging_steps", 1]
    train_forked([*run, "--gradient_accumulation_steps", accumulation, "--output_dir", tmp_path / "full"],
                 **on(zoo_file, made_on))
    resumed = train_forked([*run, "--output_dir", tmp_path / "resumed", "--resume", tmp_path / "full" / "step_5"],
                           **on(zoo_file, resumed_on))
    assert (f"on {resumed_on} process{'es' * (resumed_on > 1)}: micro-batch 8 and gradient accumulation "
            f"{made_on * accumulation // resumed_on} keep its global batch of 16") in resumed.stdout
    assert_close_run(tmp_path / "full", tmp_path / "resumed", 5)
    made = json.loads((tmp_path / "resumed" / "step_10" / "position.json").read_text())
    assert (made["world_size"], made["gradient_accumulation_steps"], made["global_batch_size"]) == \
        (resumed_on, made_on * accumulation // resumed_on, 16)
    # The accumulation asked for stays in the config: the same command resumes it on either number of processes.
    assert made["config"]["gradient_accumulation_steps"] == accumulation
    assert not [name for name in os.listdir(tmp_path / "resumed") if name.startswith(".universal_")]
    said = resumed.stdout + resumed.stderr  # DeepSpeed's conversion and load, quiet unless TEXTCLF_VERBOSE=1
    assert not [line for line in said.splitlines() if "Merging slices" in line or "MPU is not provided" in line]


@pytest.mark.slow
@pytest.mark.parametrize("zoo_file", ["cpu.yaml", "zero2.yaml"])
def test_a_checkpoint_without_accumulation_resumes_on_more_processes_in_smaller_micro_batches(
        tmp_path, args, dropout_free_model, zoo_file):
    """Made by 1 process in micro-batches of 16 with no accumulation to trade, resumed on 2 processes: each takes
    micro-batches of 8, the same examples per optimizer step; DeepSpeed is given the micro-batch of 8."""
    run = [*args, "--model", dropout_free_model, "--learning_rate", "1e-3", "--per_device_train_batch_size", 16,
           "--max_steps", 10, "--save_steps", 5, "--logging_steps", 1]
    train_forked([*run, "--output_dir", tmp_path / "full"], **on(zoo_file, 1))
    resumed = train_forked([*run, "--output_dir", tmp_path / "resumed", "--resume", tmp_path / "full" / "step_5"],
                           **on(zoo_file, 2))
    assert ("made by 1 process with micro-batch 16 and gradient accumulation 1, on 2 processes: micro-batch 8 and "
            "gradient accumulation 1 keep its global batch of 16") in resumed.stdout
    assert_close_run(tmp_path / "full", tmp_path / "resumed", 5)
    made = json.loads((tmp_path / "resumed" / "step_10" / "position.json").read_text())
    assert (made["world_size"], made["per_device_train_batch_size"], made["global_batch_size"]) == (2, 8, 16)
    assert made["config"]["per_device_train_batch_size"] == 16  # asked for: on 1 process it is 16 again
    if zoo_file != "cpu.yaml":
        import torch

        states = next((tmp_path / "resumed" / "step_10" / "pytorch_model").glob("*model_states.pt"))
        ds_config = torch.load(states, map_location="cpu", weights_only=False)["ds_config"]
        assert (ds_config["train_micro_batch_size_per_gpu"], ds_config["train_batch_size"]) == (8, 16)


def test_a_position_moved_without_its_states_is_refused_once_they_load(tmp_path):
    """The step position.json records, against the scheduler's and the optimizer's own counts (a checkpoint from
    elsewhere has nothing else to be checked by)."""
    from types import SimpleNamespace

    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([weight])
    for _ in range(3):
        weight.grad = torch.ones(2)
        optimizer.step()
    scheduler = SimpleNamespace(scheduler=SimpleNamespace(last_epoch=3))  # accelerate's wrapper
    refuse_other_counts("step_3", {"step": 3}, scheduler, optimizer)
    with pytest.raises(InputError, match=r"^cannot resume from step_4: its position.json says step 4, but its "
                                         r"scheduler has stepped 3 times and its optimizer has taken 3 steps"):
        refuse_other_counts("step_4", {"step": 4}, scheduler, optimizer)
    # fp16's loss scaler skips steps: the optimizer may count fewer, never more.
    refuse_other_counts("step_3", {"step": 3, "mixed_precision": "fp16"},
                        SimpleNamespace(last_epoch=3), torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]))


@pytest.mark.slow
def test_a_foreign_checkpoint_s_step_is_checked_against_its_scheduler(tmp_path, four_step_run):
    """An older textclf's checkpoint (no signature) with its step moved: nothing proves who wrote it, and its
    scheduler's count refuses it once loaded, before any step."""
    step_2 = shutil.copytree(four_step_run / "step_2", tmp_path / "step_2")
    reseal(step_2, step_moved, signature="stripped")
    result = train_forked(["--resume", step_2, "--output_dir", tmp_path / "out", "--max_steps", 4], config_file=None,
                          check=False)
    said = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert said == [f"error: cannot resume from {step_2}: its position.json says step 3, but its scheduler has stepped "
                    "2 times and its optimizer has taken 2 steps: the position was edited, or its files come from "
                    "different checkpoints; resume from another checkpoint"], result.stderr[-3000:]
    assert "warning: nothing proves that this user's runs wrote" in result.stderr
    assert not (tmp_path / "out" / "log.jsonl").exists()


@pytest.mark.slow
def test_deepspeed_cpu_adam_resumed_with_its_steps_replayed_steps_as_if_never_stopped():
    """The offload files' optimizer on its own (its C++ op compiled at first use): a copy loaded from a state dict
    after 20 steps matches the uninterrupted one bit for bit once its steps are replayed, and not without."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from textclf.checkpointing.load import replay_cpu_adam_steps

    gradients = [torch.randn(64, generator=torch.Generator().manual_seed(step)) for step in range(30)]

    def train(optimizer, weight, steps):
        for gradient in steps:
            weight.grad = gradient.clone()
            optimizer.step()

    def resumed(replay: bool):
        weight = torch.nn.Parameter(torch.zeros(64))
        first = DeepSpeedCPUAdam([weight], lr=1e-3)
        train(first, weight, gradients[:20])
        again = torch.nn.Parameter(weight.detach().clone())
        second = DeepSpeedCPUAdam([again], lr=1e-3)  # a new process's optimizer: its C++ side starts at step 0
        second.load_state_dict(first.state_dict())
        if replay:
            replay_cpu_adam_steps(second)
        train(second, again, gradients[20:])
        return again.detach()

    weight = torch.nn.Parameter(torch.zeros(64))
    train(DeepSpeedCPUAdam([weight], lr=1e-3), weight, gradients)
    assert torch.equal(resumed(replay=True), weight.detach())
    assert not torch.equal(resumed(replay=False), weight.detach())  # pow(beta, t) against the running product
