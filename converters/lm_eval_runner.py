"""`hf-attn eval MODEL --tasks T[,T...]`: lm-evaluation-harness tasks on a model, side by side with a reference.

The models load through `load_source` in this process, where the patch is applied, so converted checkpoints (native
GQA / MLA fields, or stock formats) load as they do for users; lm-eval's own "hf" model (`HFLM`) then runs them.
lm-eval is optional (`pip install hf-attn-patch[eval]`): it is imported here only, and a missing install or an
unknown task name is reported before any model loads.
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

INSTALL_HINT = "lm-eval is not installed: pip install 'hf-attn-patch[eval]' (or pip install lm-eval)"


@dataclass
class TaskScore:
    task: str
    metric: str
    value: float
    stderr: float | None


def task_manager(include_path: str | None = None):
    """lm-eval's TaskManager over its built-in tasks plus `include_path` (a folder of task YAMLs); raises ValueError
    with the install hint when lm-eval is missing."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError as err:
        raise ValueError(f"{INSTALL_HINT} ({err})") from err
    return TaskManager(include_path=include_path)


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


def run_tasks(model, tokenizer, tasks: list[str], manager, limit: int | None = None, batch_size: int = 1,
              num_fewshot: int | None = None) -> list[TaskScore]:  # fmt: skip
    """lm_eval.simple_evaluate on an already loaded model; one TaskScore per (task, metric) it reports."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, num_fewshot=num_fewshot, task_manager=manager,
                                  log_samples=False, bootstrap_iters=1000)  # fmt: skip
    scores = []
    for task, metrics in sorted(out["results"].items()):
        for key, value in metrics.items():
            name, _, _filter = key.partition(",")
            if name in ("alias", "sample_len") or name.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{name}_stderr,{_filter}")
            scores.append(TaskScore(task, name, float(value), float(stderr) if isinstance(stderr, (int, float)) else None))
    return scores


def table(scores: list[TaskScore], reference: list[TaskScore] | None = None, names: tuple[str, str] = ("model", "reference")) -> str:  # fmt: skip
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
