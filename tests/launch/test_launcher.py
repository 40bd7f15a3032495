"""What the launcher told this process: its environment, and the accelerate launch line read as accelerate reads it
(textclf/launch/launcher.py)."""

import os
import warnings

import pytest

from conftest import REPO

ZOO = REPO / "accelerate_configs"


def test_gpus_named_on_the_launch_line_make_a_gpu_launch_and_asking_for_the_cpu_does_not(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    from textclf.launch.launcher import gpus_named

    def named(name, *launch_args):
        line = launch_command_parser().parse_args(["--config_file", str(name), *launch_args, "train.py"])
        return gpus_named(line, load_config_from_file(str(name)))

    assert named(ZOO / "cpu.yaml") is None and named(ZOO / "cpu.yaml", "--gpu_ids", "0,1") == "0,1"
    assert named(ZOO / "ddp.yaml") == "all" and named(ZOO / "ddp.yaml", "--cpu") is None
    on_the_cpu = tmp_path / "ddp_on_cpu.yaml"
    on_the_cpu.write_text((ZOO / "ddp.yaml").read_text().replace("use_cpu: false", "use_cpu: true"))
    assert named(on_the_cpu) is None


@pytest.mark.parametrize("name", ["cpu", "ddp", "ddp_bf16", "ddp_fp16", "fsdp", "zero2", "zero2_offload", "zero3",
                                  "zero3_offload"])
def test_a_single_machine_zoo_file_takes_a_free_port_beside_another_launch(name, monkeypatch):
    """A second launch on the same machine (while the first trains, or a test beside a run) does not collide at
    torchrun's default port 29500, nor warn that it is taken: the file asks accelerate for a free port (0)."""
    import socket

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    from conftest import REPO

    monkeypatch.chdir(REPO)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # accelerate's notes about the defaults it fills in
        args, defaults = _validate_launch_command(launch_command_parser().parse_args(
            ["--config_file", f"accelerate_configs/{name}.yaml", "train.py"]))[:2]
    assert args.main_process_port == 0
    # What accelerate's launch_command sets before its DeepSpeed launcher runs.
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    with socket.socket() as first_launch, warnings.catch_warnings():
        first_launch.bind(("127.0.0.1", 29500))
        first_launch.listen()
        warnings.simplefilter("error")  # accelerate's "Port 29500 is already in use" is a warning
        (prepare_deepspeed_cmd_env if args.use_deepspeed else prepare_multi_gpu_env)(args)
    assert args.main_process_port not in (0, 29500)  # what torchrun is given


def test_the_environment_is_read_anew_as_torchrun_or_accelerate_launch_set_it(monkeypatch):
    from textclf.launch.launcher import LaunchEnvironment, launch_environment

    for key in [key for key in os.environ if key.startswith("ACCELERATE_")] + ["WORLD_SIZE", "RANK", "LOCAL_RANK",
                                                                              "GROUP_WORLD_SIZE"]:
        monkeypatch.delenv(key, raising=False)
    assert launch_environment() == LaunchEnvironment()
    for key, value in {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "GROUP_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)  # torchrun's, on the second of two machines
    torchrun = launch_environment()
    assert (torchrun.world_size, torchrun.rank, torchrun.local_rank, torchrun.num_machines) == (4, 3, 1, 2)
    assert not torchrun.by_accelerate_launch
    for key, value in {"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_DEEPSPEED": "true",
                       "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_NUM_MACHINES": "1"}.items():
        monkeypatch.setenv(key, value)
    launched = launch_environment()
    assert launched.by_accelerate_launch and launched.deepspeed and not launched.fsdp
    assert (launched.deepspeed_zero_stage, launched.mixed_precision, launched.num_machines) == (3, "bf16", 1)
