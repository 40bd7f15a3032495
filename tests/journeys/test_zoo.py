"""Every file of accelerate_configs/ launched for real on this CPU machine: the strategy it runs, the weights it
exports, a free port beside another launch."""

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification

from conftest import OFFLINE, REPO, TINY, free_port, run_train, train_command
from forked import launch_env, rank_env

pytestmark = pytest.mark.slow


ZOO = REPO / "accelerate_configs"


STEPS = 3


@pytest.fixture(scope="module")
def run_args(reviews_csv, cache_dir):
    """One tiny run, the same under every strategy: seed, data, steps."""
    return [*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--max_steps", STEPS]


def train_under(config: str, run_args, output_dir, extra_launch_args=()) -> dict:
    """Launch train.py with one zoo file; return its run.json."""
    run_train([*run_args, "--output_dir", output_dir], config_file=ZOO / config, extra_launch_args=extra_launch_args)
    return json.loads((output_dir / "run.json").read_text())


def exported_weights(output_dir) -> dict[str, torch.Tensor]:
    [weights] = (output_dir / "model").glob("*.safetensors")
    return load_file(weights)


def assert_exported_model_loads(output_dir):
    model = AutoModelForSequenceClassification.from_pretrained(output_dir / "model")
    assert model.config.id2label == {0: "negative", 1: "positive"}


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name].float() - b[name].float()).abs().max().item() for name in a)


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory, run_args):
    """cpu.yaml in fp32: the run every other strategy is compared with."""
    out = tmp_path_factory.mktemp("cpu")
    return out, train_under("cpu.yaml", run_args, out)


# What train.py reads from its launch: accelerate's settings, the rank's place, the threads per rank.
LAUNCH_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "OMP_NUM_THREADS")


def test_cpu_yaml_is_ddp_over_two_real_processes(ddp_reference):
    out, run = ddp_reference
    assert (run["distributed_type"], run["num_processes"], run["num_machines"]) == ("MULTI_CPU", 2, 1)
    assert (run["mixed_precision"], run["zero_stage"], run["zero_offload"]) == ("no", None, None)
    assert_exported_model_loads(out)


def test_cpu_yaml_with_bf16_from_the_launch_line(tmp_path, run_args):
    run = train_under("cpu.yaml", run_args, tmp_path, extra_launch_args=["--mixed_precision", "bf16"])
    assert (run["distributed_type"], run["num_processes"], run["mixed_precision"]) == ("MULTI_CPU", 2, "bf16")
    assert_exported_model_loads(tmp_path)


@pytest.mark.parametrize("config, stage, offload", [
    ("zero2.yaml", 2, {"optimizer": "none", "param": "none"}),
    ("zero2_offload.yaml", 2, {"optimizer": "cpu", "param": "none"}),
    ("zero3.yaml", 3, {"optimizer": "none", "param": "none"}),
    ("zero3_offload.yaml", 3, {"optimizer": "cpu", "param": "cpu"}),
])
def test_zero_configs_run_their_stage_and_offload_and_export_full_weights(
        tmp_path, run_args, ddp_reference, config, stage, offload):
    run = train_under(config, run_args, tmp_path)
    assert (run["distributed_type"], run["num_processes"], run["mixed_precision"]) == ("DEEPSPEED", 2, "no")
    assert (run["zero_stage"], run["zero_offload"]) == (stage, offload)
    assert_exported_model_loads(tmp_path)
    # Every parameter exported whole: the same names and shapes as DDP's export, none of them a shard,
    # and the same values: sharding (and DeepSpeedCPUAdam under offload) changes where, not what.
    reference, exported = exported_weights(ddp_reference[0]), exported_weights(tmp_path)
    assert {name: t.shape for name, t in exported.items()} == {name: t.shape for name, t in reference.items()}
    assert max_abs_diff(exported, reference) < 1e-4


def test_multi_node_yaml_as_two_machines_on_one_host(tmp_path, run_args, ddp_reference):
    """machine_rank 0 and 1 on 127.0.0.1, one process each: the same run as cpu.yaml's two processes."""
    port = free_port()
    launches = []
    for machine_rank in (0, 1):
        # Both launches meet at one port: the last --main_process_port on a command line wins.
        node = ["--num_processes", "2", "--num_machines", "2", "--machine_rank", str(machine_rank),
                "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
        command = train_command([*run_args, "--output_dir", tmp_path], ZOO / "multi_node.yaml", node)
        launches.append(subprocess.Popen(command, cwd=REPO, env={**os.environ, **OFFLINE},
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [launch.communicate(timeout=900)[0] for launch in launches]
    for launch, output in zip(launches, outputs):
        assert launch.returncode == 0, output[-6000:]
    run = json.loads((tmp_path / "run.json").read_text())
    assert (run["distributed_type"], run["num_processes"], run["num_machines"]) == ("MULTI_CPU", 2, 2)
    assert_exported_model_loads(tmp_path)
    assert max_abs_diff(exported_weights(tmp_path), exported_weights(ddp_reference[0])) < 1e-4


@pytest.mark.parametrize("config, launch_args", [("cpu.yaml", []), ("cpu.yaml", ["--mixed_precision", "bf16"]),
                                                 ("zero2.yaml", []), ("zero3_offload.yaml", [])])
def test_forked_ranks_get_the_environment_accelerate_launch_gives(tmp_path, config, launch_args):
    """tests/forked.py builds each rank's environment with accelerate's launch code, without the launcher:
    what train.py reads from it is what a real `accelerate launch` gives each rank."""
    script = tmp_path / "env.py"
    script.write_text("import json, os, sys\nwith open(sys.argv[1] + os.environ['RANK'], 'w') as f:\n"
                      "    json.dump(dict(os.environ), f)\n")
    launched = subprocess.run(train_command([tmp_path / "rank"], ZOO / config, launch_args, script), cwd=REPO,
                              capture_output=True, text=True, timeout=300, env={**os.environ, **OFFLINE})
    assert launched.returncode == 0, launched.stderr[-3000:]
    real = [json.loads((tmp_path / f"rank{rank}").read_text()) for rank in range(2)]
    forked = [rank_env(launch_env(ZOO / config, 2, free_port(), launch_args), rank) for rank in range(2)]

    def read(env):
        return {key: value for key, value in env.items() if key.startswith("ACCELERATE_") or key in LAUNCH_KEYS}

    assert [read(env) for env in forked] == [read(env) for env in real]


def test_a_zero3_launch_prints_no_library_warnings(tmp_path, run_args):
    """ZeRO-3 calls torch's deprecated collectives at every step (a FutureWarning each time, 1,800 lines in 30
    steps), transformers draws its bars loading weights: none of it reaches the console unless TEXTCLF_VERBOSE=1."""
    result = run_train([*run_args, "--max_steps", 6, "--logging_steps", 2, "--output_dir", tmp_path],
                       config_file=ZOO / "zero3.yaml", env={"DS_ACCELERATOR": "cpu"})  # the launcher's own line
    output = (result.stdout + result.stderr).replace("\r", "\n").splitlines()
    noise = [line for line in output if any(word in line for word in (
        "Warning", "warnings.warn", "is deprecated", "Loading weights", "Setting accelerator", "MPU is not"))]
    assert noise == [], "\n".join(noise[:20])
