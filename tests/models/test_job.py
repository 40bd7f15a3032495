"""The training job (textclf/models/job.py): data, tokenizer and model from one config."""

from conftest import TINY, read_csv
from textclf.cli import parse_config
from textclf.models.job import load_data


def test_load_data_reads_the_same_examples_as_before(tmp_path, reviews_csv):
    cfg = parse_config([*TINY, "--data", str(reviews_csv), "--output_dir", "unused"])
    train_set, eval_set, names, fingerprint = load_data(cfg)
    rows = read_csv(reviews_csv)
    assert len(train_set) + len(eval_set) == len(rows) and sorted(names) == ["negative", "positive"]
    assert set(train_set["text"]) | set(eval_set["text"]) == {row["review"].strip() for row in rows}
