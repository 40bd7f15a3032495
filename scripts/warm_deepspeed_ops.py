"""Compile the DeepSpeed C++ ops that the zoo loads, once, before anything is timed.

    python scripts/warm_deepspeed_ops.py

DeepSpeed compiles its ops at first use into the torch extensions cache (~/.cache/torch_extensions,
or $TORCH_EXTENSIONS_DIR) and loads them from there afterwards. Measured here, first use costs about
45 s for the shared-memory comm op, which every DeepSpeed launch on a CPU loads, and about 60 s for
cpu_adam, which the *_offload configs load; under a test's timeout, and with every test racing for
the same lock, that is a flaky suite. CI runs this script in one step before the tests.

The ops are built with -march=native: a cache belongs to one machine type, so warm it where the
tests run rather than restoring it from elsewhere. On a CUDA machine only cpu_adam is built: the
offload files step the optimizer on the CPU there too (scripts/gpu_suite.py runs this first).
"""

import os
import sys
import time

import torch

# Op builders, by the names DeepSpeed's accelerator knows them, who loads each one, and whether a CUDA
# machine loads it too.
OPS = {
    "ShareMemCommBuilder": ("deepspeed.comm at initialisation on CPU (every zero*.yaml launch)", False),
    "CPUAdamBuilder": ("DeepSpeedCPUAdam, which accelerate swaps in for offload_optimizer (zero*_offload.yaml)",
                       True),
}


def main() -> int:
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import get_default_build_root

    accelerator = get_accelerator()
    print(f"torch extensions cache: {os.environ.get('TORCH_EXTENSIONS_DIR') or get_default_build_root()}")
    for name, (user, on_cuda) in OPS.items():
        if torch.cuda.is_available() and not on_cuda:
            continue
        builder = accelerator.create_op_builder(name)
        if builder is None:
            print(f"error: DeepSpeed's {accelerator.device_name()} accelerator has no {name}", file=sys.stderr)
            return 1
        start = time.perf_counter()
        builder.load(verbose=False)  # compiles on first use, loads from the cache afterwards
        print(f"{builder.name}: ready in {time.perf_counter() - start:.1f} s (used by {user})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
