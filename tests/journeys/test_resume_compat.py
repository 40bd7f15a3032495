"""A checkpoint written before textclf's modules moved into subpackages (commit 3b02297) still resumes, bit for bit: the
resumed run logs the losses and ends with the weights of the uninterrupted run that wrote it
(tests/fixtures/checkpoint_before_subpackages/README.md says how the fixture was made)."""

import json
import platform
import shutil

import pytest
from safetensors.torch import load_file

from conftest import REPO, losses, read_log, train_forked

FIXTURE = REPO / "tests" / "fixtures" / "checkpoint_before_subpackages"


STEP = 4  # the fixture's checkpoint; its run went on to step 8


def this_machine() -> dict:
    """What, beside the code, decides the bits of a CPU run (the fixture's machine.json): the CPU's architecture,
    vendor and SIMD width (torch and MKL choose their kernels by them), and torch itself."""
    import torch

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            vendor = next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), None)
    except OSError:
        vendor = None
    return {"machine": platform.machine(), "cpu_vendor": vendor,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__}


def evaluations(output_dir) -> list[dict]:
    return [{key: value for key, value in row.items() if key.startswith("eval_")} for row in read_log(output_dir)
            if any(key.startswith("eval_") for key in row)]


def differences(uninterrupted, resumed, weights) -> list[str]:
    """How the resumed run differs from the uninterrupted one: its losses after STEP, its evaluations, its final
    weights (`weights`: the uninterrupted run's export)."""
    expected, got = losses(uninterrupted), losses(resumed)
    later = sorted(step for step in expected if step > STEP)
    assert later and sorted(got) == later, f"the resumed run logged losses at steps {sorted(got)}, expected {later}"
    found = [f"loss at step {step}: {got[step]!r}, uninterrupted {expected[step]!r}" for step in later
             if got[step] != expected[step]]
    if evaluations(resumed) != evaluations(uninterrupted):
        found.append(f"evaluations {evaluations(resumed)}, uninterrupted {evaluations(uninterrupted)}")
    reference, final = load_file(weights), load_file(resumed / "model" / "model.safetensors")
    assert final.keys() == reference.keys(), sorted(final.keys() ^ reference.keys())
    found += [f"weight {name}: off by up to {(final[name] - reference[name]).abs().max().item():.3g}"
              for name in sorted(reference) if not final[name].equal(reference[name])]
    return found


def test_a_checkpoint_written_before_the_subpackages_resumes_bitwise(tmp_path):
    """By path alone, as a user resumes: the checkpoint's config gives every flag. It names its data and model by
    paths relative to the repository (train.py's working directory here), which a resume may not change; the copy
    in tmp_path is only written beside. One thread, as the fixture was written: other thread counts add in other
    orders."""
    checkpoint = shutil.copytree(FIXTURE / f"step_{STEP}", tmp_path / f"step_{STEP}")
    resumed = tmp_path / "resumed"
    result = train_forked(["--resume", checkpoint, "--output_dir", resumed, "--cache_dir", tmp_path / "cache"],
                          config_file=None, env={"OMP_NUM_THREADS": "1"})
    assert f"resumed from {checkpoint} at optimizer step {STEP}" in result.stdout, result.stdout[-3000:]
    # Unsigned (signatures came later): from elsewhere, said in one line, and it needs no flag (no pickle).
    assert f"warning: nothing proves that this user's runs wrote {checkpoint}: it is not signed" in result.stderr
    found = differences(FIXTURE / "uninterrupted", resumed, FIXTURE / "uninterrupted" / "model.safetensors")
    made_on = json.loads((FIXTURE / "machine.json").read_text(encoding="utf-8"))
    if found and this_machine() != made_on:
        pytest.skip(f"this machine ({this_machine()}) computes other bits than the one that wrote the fixture "
                    f"({made_on}), so they cannot be compared here: {found[0]}")
    assert not found, "the resumed run differs from the uninterrupted one:\n" + "\n".join(found)
