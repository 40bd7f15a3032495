"""The benchmark: one training job under every strategy this machine can run, each measured the same way.

    python -m benchmarks --quick      # from the repository root (see __main__.py for the options)

It stands apart from the `textclf` package: training never imports it, and it is not installed.
It builds its jobs with textclf's own pieces (build_job, the theory, the log format), so that what it
measures is what train.py does.

    plan.py       what runs: the jobs, the rows of each, and the command that launches each row
    measure.py    running a row and measuring it; the data and the model's shape of each job
    report.py     bench.md, bench.json and bench.png
    baselines.py  the plain PyTorch loop and the HF Trainer, launched as rows beside train.py
    decoder.py    the decoder job: a 0.5B decoder's peak memory per rank under DDP and ZeRO, beside the
                  check's prediction (python -m benchmarks.decoder)
    __main__.py   the command
"""
