"""The `accelerate launch` line that started a run, read as accelerate reads it: how many processes it asked for."""

import logging
import os
import warnings
from typing import Optional

import psutil


def fewer_processes(started: int, requested: int, distributed_type: str, path: Optional[str]) -> Optional[str]:
    """The line that says a launch starts fewer processes than asked for (train.py warns, the check refuses), or
    None. accelerate's simple launcher, which NO and MULTI_CPU (without mpirun) yamls get, starts one."""
    if started >= requested:
        return None
    return (f"{path or 'the launch'}: distributed_type {distributed_type} starts a single process"
            f"{' without mpirun' if distributed_type == 'MULTI_CPU' else ''}, not the {requested} asked for; for "
            "several use MULTI_GPU, as accelerate_configs/cpu.yaml does on a CPU (train.py uses gloo there), or "
            "--multi_gpu on the launch line")


def shortfall(started: int, launch_line: Optional[list[str]] = None) -> Optional[str]:
    """fewer_processes for the `accelerate launch` that started this run (launch.launch_shortfall): its line (by
    default the parent process's) read as accelerate reads it, with the yaml or the default config that `accelerate
    config` wrote. None when it asked for no more than started, or when no `accelerate launch` started this run."""
    if launch_line is None:
        command = psutil.Process().parent().cmdline()
        ends = [i for i, arg in enumerate(command) if arg == "launch" or arg.endswith("accelerate.commands.launch")]
        if not ends:
            return None
        launch_line = command[ends[0] + 1:]
    from accelerate.commands.config.config_args import default_config_file, load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    try:
        args = launch_command_parser().parse_args(launch_line)
        logger = logging.getLogger("accelerate.commands.launch")
        level = logger.level
        logger.setLevel(logging.ERROR)  # its warnings about defaults were printed by the launch itself
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # accelerate's private merge of the yaml and the launch line, what its launcher itself reads (no
                # public one); tests/test_users.py's shortfall test fails if it changes
                args = _validate_launch_command(args)[0]
        finally:
            logger.setLevel(level)
        path = args.config_file or (default_config_file if os.path.isfile(default_config_file) else None)
        kind = load_config_from_file(path).distributed_type if path else "NO"
    except (SystemExit, ValueError):  # a line this accelerate reads otherwise: nothing to say about it
        return None
    return fewer_processes(started, args.num_processes or 1, str(getattr(kind, "value", kind)), path)
