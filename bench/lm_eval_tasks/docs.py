"""The documents of the shipped lm-eval tasks: each task's YAML names a jsonl file next to this
module (`dataset_kwargs.file`), and lm-eval resolves `!function docs.load` relative to the
YAML, so the tasks load wherever the repository is (`lm_eval --include_path
bench/lm_eval_tasks`). Runs inside .venv-clients (lm-eval's environment), not .venv."""

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def load(file: str, **_metadata: Any) -> Any:
    """A one-split ("test") dataset of the rows of `file`; the rest of what lm-eval passes
    (the task's metadata) is not ours."""
    import datasets  # lm-eval's environment has it; .venv need not

    path = HERE / file
    if path.parent != HERE or path.suffix != ".jsonl":
        raise ValueError(f"dataset_kwargs.file: {file!r} is not a jsonl file in {HERE}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
