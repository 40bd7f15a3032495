"""Compile the DeepSpeed C++ ops that the zoo loads, once, before anything is timed.

    python scripts/warm_deepspeed_ops.py

DeepSpeed compiles its ops at first use into the torch extensions cache (~/.cache/torch_extensions,
or $TORCH_EXTENSIONS_DIR) and loads them from there afterwards. Measured here, first use costs about
45 s for the shared-memory comm op, which every DeepSpeed launch on a CPU loads, and about 60 s for
cpu_adam, which the *_offload configs load; under a test's timeout, and with every test racing for
the same lock, that is a flaky suite. CI runs this script in one step before the tests. A launch
that finds an op missing compiles it itself, and says so (textclf.launch.load_deepspeed_ops, which
this script calls too: a lock left in the cache by a killed build is cleared or reported first).

The ops are built with -march=native: a cache belongs to one machine type, so warm it where the
tests run rather than restoring it from elsewhere. On a CUDA machine only cpu_adam is built: the
offload files step the optimizer on the CPU there too (scripts/gpu_suite.py runs this first).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's textclf

from textclf.launch import load_deepspeed_ops  # noqa: E402

# The ops the zoo loads, by builder name: who loads each, and whether a CUDA machine loads it too.
OPS = {
    "ShareMemCommBuilder": ("deepspeed.comm on a CPU (every zero*.yaml launch without CUDA)", False),
    "CPUAdamBuilder": ("DeepSpeedCPUAdam, which accelerate swaps in for offload_optimizer (zero*_offload.yaml)", True),
}


def main() -> int:
    from torch.utils.cpp_extension import get_default_build_root

    print(f"torch extensions cache: {os.environ.get('TORCH_EXTENSIONS_DIR') or get_default_build_root()}")
    for name, (user, on_cuda) in OPS.items():
        if torch.cuda.is_available() and not on_cuda:
            continue
        seconds = load_deepspeed_ops([name])
        if not seconds:
            print(f"error: DeepSpeed has no {name} compatible with this machine", file=sys.stderr)
            return 1
        for op, took in seconds.items():
            print(f"{op}: ready in {took:.1f} s (used by {user})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
