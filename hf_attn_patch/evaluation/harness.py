"""`hf-attn eval MODEL --tasks T[,T...]`: lm-evaluation-harness tasks on a model, side by side with a reference.

The models load through `load_source` in this process, where the patch is applied, so converted checkpoints (native
GQA / MLA fields, or stock formats) load as they do for users; lm-eval's own "hf" model (`HFLM`) then runs them.
lm-eval is optional (`pip install hf-attn-patch[eval]`): it is imported here only, and a missing install or an
unknown task name is reported before any model loads.

Offline zero-shot tasks ship with the package (assets/lm_eval_tasks, tag `zero_shot_offline`): lm-eval's hellaswag,
arc_easy, arc_challenge, piqa and winogrande prompts and metrics, read from local files instead of the Hub. Their
folder is given by --eval-data DIR (or the HF_ATTN_EVAL_DATA environment variable); OFFLINE_FILES lists the files
expected in it.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

logger = logging.getLogger(__name__)

INSTALL_HINT = "lm-eval is not installed: pip install 'hf-attn-patch[eval]' (or pip install lm-eval)"
EVAL_DATA_ENV = "HF_ATTN_EVAL_DATA"
OFFLINE_TAG = "zero_shot_offline"
# task -> (file under the data folder, split name): lm-eval's stock fields (hellaswag: the original jsonl layout)
OFFLINE_FILES = {
    "hellaswag_offline": ("hellaswag/hellaswag_val.jsonl", "validation"),
    "arc_easy_offline": ("arc_easy/lmeval_test.jsonl", "test"),
    "arc_challenge_offline": ("arc_challenge/lmeval_test.jsonl", "test"),
    "piqa_offline": ("piqa/lmeval_validation.jsonl", "validation"),
    "winogrande_offline": ("winogrande/dev.jsonl", "validation"),
}
# the accuracy averaged per task (the field's usual choice: length-normalised where lm-eval reports it)
HEADLINE_METRIC = {
    "hellaswag_offline": "acc_norm",
    "arc_easy_offline": "acc_norm",
    "arc_challenge_offline": "acc_norm",
    "piqa_offline": "acc_norm",
    "winogrande_offline": "acc",
}


def offline_tasks_dir() -> Path:
    """The package's folder of offline task YAMLs."""
    return Path(str(files("hf_attn_patch") / "assets" / "lm_eval_tasks"))


def check_eval_data(tasks: list[str], data_dir: str | None) -> None:
    """Raise ValueError, before any model loads, when an offline task is asked for without a data folder or its file
    is missing there."""
    wanted = sorted(OFFLINE_FILES) if OFFLINE_TAG in tasks else [t for t in tasks if t in OFFLINE_FILES]
    if not wanted:
        return
    if not data_dir:
        raise ValueError(
            f"tasks {', '.join(wanted)} read local files: give their folder with --eval-data DIR "
            f"(or {EVAL_DATA_ENV}=DIR)"
        )
    missing = [
        str(Path(data_dir) / OFFLINE_FILES[t][0])
        for t in wanted
        if not (Path(data_dir) / OFFLINE_FILES[t][0]).is_file()
    ]
    if missing:
        raise ValueError(f"eval data {data_dir!r} lacks {', '.join(missing)}")


def load_offline(task: str):
    """The rows of an offline task as a datasets.DatasetDict {split: Dataset}, from the folder in HF_ATTN_EVAL_DATA
    (hellaswag: lm-eval's own preprocessing into query / choices / label)."""
    import datasets

    data_dir = os.environ.get(EVAL_DATA_ENV)
    check_eval_data([task], data_dir)
    name, split = OFFLINE_FILES[task]
    rows = [
        json.loads(line) for line in (Path(data_dir) / name).read_text(encoding="utf-8").splitlines() if line.strip()
    ]
    if task == "hellaswag_offline":
        rows = [
            {
                "query": _hellaswag_clean(r["activity_label"] + ": " + r["ctx_a"] + " " + r["ctx_b"].capitalize()),
                "choices": [_hellaswag_clean(e) for e in r["endings"]],
                "label": int(r["label"]),
            }
            for r in rows
        ]
    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows)})


def _hellaswag_clean(text: str) -> str:
    """lm-eval's hellaswag preprocess: WikiHow's bracketed artifacts removed."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


@dataclass
class TaskScore:
    task: str
    metric: str
    value: float
    stderr: float | None


def task_manager(include_path: str | None = None):
    """lm-eval's TaskManager over its built-in tasks, the package's offline tasks and `include_path` (a folder of
    task YAMLs); raises ValueError with the install hint when lm-eval is missing."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError as err:
        raise ValueError(f"{INSTALL_HINT} ({err})") from err
    return TaskManager(include_path=[str(offline_tasks_dir())] + ([include_path] if include_path else []))


def average_accuracy(scores: list[TaskScore]) -> float:
    """Mean over the offline tasks present of each one's HEADLINE_METRIC."""
    values = [s.value for s in scores if HEADLINE_METRIC.get(s.task) == s.metric]
    if not values:
        raise ValueError("no offline zero-shot task in the scores")
    return sum(values) / len(values)


def check_tasks(tasks: list[str], manager) -> None:
    """Raise ValueError naming every unknown task (tasks, groups and tags count), with close matches."""
    if not tasks:
        raise ValueError("tasks=[]: give at least one lm-eval task name")
    known = set(manager.all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        hints = {t: difflib.get_close_matches(t, known, n=3) for t in unknown}
        detail = "; ".join(f"{t!r} (did you mean {', '.join(h)}?)" if h else repr(t) for t, h in hints.items())
        raise ValueError(f"unknown lm-eval task(s): {detail}. `lm-eval ls tasks` lists them")


def run_tasks(
    model,
    tokenizer,
    tasks: list[str],
    manager,
    limit: int | None = None,
    batch_size: int = 1,
    num_fewshot: int | None = None,
) -> list[TaskScore]:
    """lm_eval.simple_evaluate on an already loaded model; one TaskScore per (task, metric) it reports."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        limit=limit,
        num_fewshot=num_fewshot,
        task_manager=manager,
        log_samples=False,
        bootstrap_iters=1000,
    )
    scores = []
    for task, metrics in sorted(out["results"].items()):
        for key, value in metrics.items():
            name, _, _filter = key.partition(",")
            if name in ("alias", "sample_len") or name.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{name}_stderr,{_filter}")
            scores.append(
                TaskScore(task, name, float(value), float(stderr) if isinstance(stderr, (int, float)) else None)
            )
    return scores


def table(
    scores: list[TaskScore], reference: list[TaskScore] | None = None, names: tuple[str, str] = ("model", "reference")
) -> str:
    """A plain-text table: task, metric, model value (+- stderr), and with a reference its value and the difference."""
    ref = {(s.task, s.metric): s for s in reference or []}

    def cell(s: TaskScore | None) -> str:
        if s is None:
            return "-"
        return f"{s.value:.4f}" + (f" +- {s.stderr:.4f}" if s.stderr is not None else "")

    header = ["task", "metric", names[0]] + ([names[1], "difference"] if reference is not None else [])
    rows = []
    for s in scores:
        row = [s.task, s.metric, cell(s)]
        if reference is not None:
            r = ref.get((s.task, s.metric))
            row += [cell(r), f"{s.value - r.value:+.4f}" if r else "-"]
        rows.append(row)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
