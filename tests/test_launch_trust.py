"""What a launch is trusted to run, said before anything trains: a GPU file of the zoo on a machine without CUDA is
one `error:` line (not its processes silently training on the CPU), by the rule the check calls a conflict; and a
resume that would be refused for several reasons names them all in one launch."""

import json
import os
import subprocess
import sys

import pytest

from conftest import OFFLINE, REPO, TINY, free_port, run_train
from forked import launch_env, rank_env

ZOO = REPO / "accelerate_configs"
GPU_FILES = ["ddp.yaml", "ddp_bf16.yaml", "ddp_fp16.yaml", "single_gpu.yaml", "fsdp.yaml"]
CPU_FILES = ["cpu.yaml", "zero2.yaml", "zero3.yaml", "multi_node.yaml"]


def launched_as(monkeypatch, name: str, launch_args=()) -> list[str]:
    """This process set up as a rank of `accelerate launch --config_file <zoo file> <launch_args> train.py` sets it
    up (its environment, by accelerate's own launch code) on a machine without CUDA; returns the launch line, which
    train.py reads from its parent process."""
    import torch

    from textclf.launch import launch_line

    processes = 1 if name == "single_gpu.yaml" else 2
    line = ["--config_file", str(ZOO / name), "--num_processes", str(processes), *launch_args, "train.py"]
    for key in [key for key in os.environ if key.startswith(("ACCELERATE_", "FSDP_"))]:
        monkeypatch.delenv(key)
    for key, value in rank_env(launch_env(ZOO / name, processes, free_port(), launch_args), 0).items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(launch_line, "parent_launch_line", lambda: line)
    return line


@pytest.mark.parametrize("name", GPU_FILES)
def test_each_gpu_file_of_the_zoo_is_refused_in_one_line_on_a_machine_without_cuda(monkeypatch, name):
    """What accelerate would run instead: ddp*.yaml its 8 processes on the CPU, single_gpu.yaml the one, fsdp.yaml
    plain DDP; train.py refuses each before the data or the model, sending it to the CPU files."""
    import yaml

    from textclf.cli import parse_config
    from textclf.errors import InputError
    from textclf.launch.checks import check_launch_early, cuda_only

    launched_as(monkeypatch, name)
    with pytest.raises(InputError) as refused:
        check_launch_early(parse_config(["--report_to", "none"]))
    config = yaml.safe_load((ZOO / name).read_text())
    [(need, fix)] = cuda_only("FSDP" if config["distributed_type"] == "FSDP" else None, config["mixed_precision"],
                              str(config["gpu_ids"]))
    assert str(refused.value) == f"{ZOO / name}: {need}, and this machine has none: {fix}"
    assert "accelerate_configs/cpu.yaml" in fix and "zero3.yaml" in fix


@pytest.mark.parametrize("name, launch_args", [(name, ()) for name in CPU_FILES]
                         + [("cpu.yaml", ("--mixed_precision", "bf16")), ("cpu.yaml", ("--num_processes", "8"))])
def test_the_cpu_files_are_not_refused_on_a_machine_without_cuda(monkeypatch, name, launch_args):
    """cpu.yaml is MULTI_GPU on purpose (train.py forms a gloo group without CUDA), the ZeRO files run on a CPU
    over gloo: with bf16 or more processes than cores, they are still what they say."""
    from textclf.cli import parse_config
    from textclf.launch.checks import check_launch_early

    launched_as(monkeypatch, name, launch_args)
    check_launch_early(parse_config(["--report_to", "none"]))


def test_gpus_named_on_the_launch_line_make_a_gpu_launch_and_asking_for_the_cpu_does_not(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    from textclf.launch.launch_line import gpus_named

    def named(name, *launch_args):
        line = launch_command_parser().parse_args(["--config_file", str(name), *launch_args, "train.py"])
        return gpus_named(line, load_config_from_file(str(name)))

    assert named(ZOO / "cpu.yaml") is None and named(ZOO / "cpu.yaml", "--gpu_ids", "0,1") == "0,1"
    assert named(ZOO / "ddp.yaml") == "all" and named(ZOO / "ddp.yaml", "--cpu") is None
    on_the_cpu = tmp_path / "ddp_on_cpu.yaml"
    on_the_cpu.write_text((ZOO / "ddp.yaml").read_text().replace("use_cpu: false", "use_cpu: true"))
    assert named(on_the_cpu) is None


def test_the_environment_cannot_tell_a_gpu_file_from_cpu_yaml():
    """Why the rule reads the launch line: ddp_bf16.yaml gives its ranks the environment of cpu.yaml with bf16 on as
    many processes, gpu_ids all setting no variable."""
    port = free_port()

    def launched(name, launch_args=()):
        env = launch_env(ZOO / name, 8, port, launch_args)
        return {key: value for key, value in env.items() if key.startswith(("ACCELERATE_", "FSDP_", "CUDA_"))
                or key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")}

    assert launched("ddp_bf16.yaml") == launched("cpu.yaml", ["--mixed_precision", "bf16"])


@pytest.mark.slow
def test_ddp_bf16_yaml_launched_on_a_machine_without_cuda_is_one_line_and_trains_nothing(tmp_path, reviews_csv):
    """The launch as users type it, the yaml's own 8 processes: one line from the first rank, none trained."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU runs ddp_bf16.yaml")
    out = tmp_path / "out"
    result = run_train([*TINY, "--data", reviews_csv, "--max_steps", 2, "--output_dir", out],
                       config_file=ZOO / "ddp_bf16.yaml", check=False, timeout=600)
    said = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(said) == 1, result.stderr[-3000:]
    assert said[0].startswith(f"error: {ZOO / 'ddp_bf16.yaml'}: gpu_ids all makes it a GPU launch") \
        and "accelerate_configs/cpu.yaml" in said[0], said
    assert "MULTI_CPU" not in result.stdout and "data:" not in result.stdout and not out.exists()


def zero2_checkpoints(folder, steps=(10, 12)) -> list:
    """step_<N>/ folders of a ZeRO-2 run on 2 processes, each with a sealed position.json (no states: the refusals
    come before any is read)."""
    import dataclasses

    from textclf.checkpointing.write import sealed
    from textclf.config import TrainConfig

    made_with = {"model": "scratch-tiny", "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1}
    paths = []
    for step in steps:
        path = folder / f"step_{step}"
        path.mkdir(parents=True)
        config = {**dataclasses.asdict(TrainConfig()), **made_with, "output_dir": str(folder)}
        (path / "position.json").write_text(json.dumps(sealed({
            "step": step, "epoch": 0, "batch_in_epoch": step, "world_size": 2, "zero_stage": 2,
            "mixed_precision": "no", "global_batch_size": 16, **made_with, "config": config})))
        paths.append(path)
    return paths


def resume_refusals(checkpoint, later: str) -> list[str]:
    return [f"--resume {checkpoint}: {checkpoint.parent} holds checkpoints after it ({later}), which this run would "
            "write over; pass --overwrite_output_dir to move them aside, or --output_dir <another folder> to keep "
            "both runs",
            f"cannot resume from {checkpoint}: it was made with seed = 42, this run has 7; a resumed run keeps what "
            "shapes its training (leave out --seed, or start a new run in another --output_dir)"]


def test_a_resume_refused_twice_names_both_refusals_in_one_launch_before_torch(tmp_path):
    """`accelerate launch --config_file accelerate_configs/zero2.yaml train.py --resume checkpoints/step_10 --seed 7`
    beside a later step_12: both refusals at once, not one a launch."""
    step_10, _ = zero2_checkpoints(tmp_path / "run")
    env = {**os.environ, **OFFLINE, **rank_env(launch_env(ZOO / "zero2.yaml", 2, free_port()), 0)}
    result = subprocess.run([sys.executable, "-X", "importtime", "train.py", "--resume", str(step_10), "--seed", "7"],
                            cwd=REPO,
                            capture_output=True, text=True, timeout=120, env=env)
    said = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-3000:]
    assert said == [f"error: {line}" for line in resume_refusals(step_10, "step_12")], result.stderr[-3000:]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    assert not {"torch", "transformers", "datasets", "accelerate"} & imported
    assert sorted(os.listdir(tmp_path / "run")) == ["step_10", "step_12"]


def test_the_plan_adds_the_refusals_to_a_list_it_is_given_and_goes_on(tmp_path, monkeypatch):
    """The check command's use of plan_run: every refusal as a conflict, with the config the resume would train
    with; train.py's raises them together."""
    from textclf.cli import parse_config, plan_run
    from textclf.errors import InputError

    step_10, _ = zero2_checkpoints(tmp_path / "run")
    for key, value in rank_env(launch_env(ZOO / "zero2.yaml", 2, free_port()), 0).items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(REPO)
    argv = ["--resume", str(step_10), "--seed", "7"]
    refusals = []
    cfg, start = plan_run(parse_config(argv), argv, refusals)
    assert refusals == resume_refusals(step_10, "step_12")
    assert (start.checkpoint, cfg.model, cfg.per_device_train_batch_size) == (str(step_10), "scratch-tiny", 8)
    with pytest.raises(InputError) as refused:
        plan_run(parse_config(argv), argv)
    assert str(refused.value).splitlines() == refusals
    argv = ["--resume", str(step_10), "--overwrite_output_dir"]
    assert plan_run(parse_config(argv), argv)[1].checkpoint == str(step_10)
