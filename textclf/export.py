"""Export: a trained classifier as a self-contained Hugging Face folder, written atomically and verified.

    python -m textclf.export checkpoints/step_500 exported/             # from any step_<N> checkpoint
    python -m textclf.export checkpoints/step_500 exported/ --merge     # LoRA merged into a plain model
    python -m textclf.export checkpoints/model merged/ --merge          # or from an exported LoRA folder

Whatever wrote the source (one process, DDP, ZeRO-2/3, FSDP), the folder is the one train.py exports at
the end of a run (its layout, with LoRA too: docs/after-training.md), verified the same way before it takes
the target's place: no empty tensor, it reloads, and it predicts what the trained model predicts.
"""

import argparse
from typing import Optional

from textclf.cli import add_loading_options
from textclf.config import require_trained_model
from textclf.errors import run_command


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m textclf.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a step_<N> checkpoint folder, or a model folder that export wrote")
    parser.add_argument("target", help="the folder to write (refused if it exists, unless --overwrite)")
    parser.add_argument("--merge", action="store_true", help="merge LoRA adapters into a plain model")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing target")
    add_loading_options(parser)
    args = parser.parse_args(argv)
    require_trained_model(args.source)
    return args


if __name__ == "__main__":
    # The command line first: --help and a mistyped flag answer at once, not after the imports below.
    ARGS = run_command(parse_args)


from textclf.launch import scoped
from textclf.models import load_trained, read_training, refuse_existing, save_verified


def export_checkpoint(source: str, target: str, *, merge: bool = False, overwrite: bool = False,
                      allow_pickle: bool = False, trust_remote_code: bool = False) -> str:
    """Export a step_<N> checkpoint (or re-export a model folder, e.g. to merge its LoRA adapter), with the
    config of the run that made it."""
    refuse_existing(target, overwrite)  # before the slow part
    model, tokenizer = load_trained(source, allow_pickle, trust_remote_code)
    return save_verified(model, tokenizer, target, merge=merge, overwrite=overwrite, training=read_training(source),
                         trust_remote_code=trust_remote_code)


@scoped
def main(argv=None, args: Optional[argparse.Namespace] = None) -> None:
    args = args or parse_args(argv)
    export_checkpoint(args.source, args.target, merge=args.merge, overwrite=args.overwrite,
                      allow_pickle=args.allow_pickle, trust_remote_code=args.trust_remote_code)
    print(f"exported {args.source} to {args.target} (verified: weights complete, reloads, same predictions)")


if __name__ == "__main__":
    run_command(lambda: main(args=ARGS))
