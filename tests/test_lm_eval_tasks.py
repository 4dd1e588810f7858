"""The offline zero-shot tasks (hf_attn_patch/assets/lm_eval_tasks): lm-eval's hellaswag / arc / piqa / winogrande
prompts over local files, through `hf-attn eval --tasks ... --eval-data DIR`.

Each task's accuracy on a few items is checked against our own loglikelihood argmax over the same prompts
(lm-eval's context / continuation split), so a wrong field, prompt or label cannot pass.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from hf_attn_patch import cli
from hf_attn_patch.evaluation import harness
from hf_attn_patch.evaluation.harness import OFFLINE_FILES, load_offline, offline_tasks_dir

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install hf-attn-patch[eval])")

EVALS = Path(__file__).resolve().parents[2] / "shared" / "evals"
needs_data = pytest.mark.skipif(not EVALS.exists(), reason="../shared/evals not present")
LIMIT = 4
ROWS = {
    "hellaswag_offline": 10042,
    "arc_easy_offline": 2376,
    "arc_challenge_offline": 1172,
    "piqa_offline": 1838,
    "winogrande_offline": 1267,
}  # the SOURCE.md counts


def logprob(model, tokenizer, context: str, continuation: str) -> float:
    """Summed log-probability of `continuation` after `context`, split as lm-eval's HF model splits it (trailing
    spaces of the context move to the continuation; continuation tokens = enc(whole)[len(enc(context)):])."""
    spaces = len(context) - len(context.rstrip())
    context, continuation = context[: len(context) - spaces], context[len(context) - spaces :] + continuation
    ctx = tokenizer(context, add_special_tokens=False).input_ids
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    with torch.no_grad():
        logp = model(torch.tensor([whole])).logits[0].log_softmax(-1)
    return sum(float(logp[i - 1, whole[i]]) for i in range(len(ctx), len(whole)))


def prompts(task: str, doc: dict) -> tuple[list[tuple[str, str]], int]:
    """[(context, continuation) per choice], gold index: the YAMLs' templates written out by hand."""
    if task == "hellaswag_offline":
        return [(doc["query"], " " + c) for c in doc["choices"]], doc["label"]
    if task.startswith("arc_"):
        context = f"Question: {doc['question']}\nAnswer:"
        return [(context, " " + c) for c in doc["choices"]["text"]], doc["choices"]["label"].index(doc["answerKey"])
    if task == "piqa_offline":
        return [(f"Question: {doc['goal']}\nAnswer:", " " + s) for s in (doc["sol1"], doc["sol2"])], doc["label"]
    blank = doc["sentence"].index("_")  # winogrande: each option in the blank, the rest of the sentence scored
    rest = " " + doc["sentence"][blank + 1 :].strip()
    return [(doc["sentence"][:blank] + o, rest) for o in (doc["option1"], doc["option2"])], int(doc["answer"]) - 1


def table_rows(output: str) -> dict[tuple[str, str], float]:
    rows = [re.split(r"\s{2,}", line.strip()) for line in output.strip().splitlines()[2:]]
    return {(r[0], r[1]): float(r[2].split()[0]) for r in rows}


@needs_data
def test_every_offline_task_scores_as_our_own_argmax(stories, capsys, monkeypatch):
    monkeypatch.setenv(harness.EVAL_DATA_ENV, "/nonexistent")  # --eval-data overrides it; restored after
    cli.main(["eval", "default", "--tasks", "zero_shot_offline", "--limit", str(LIMIT), "--eval-data", str(EVALS)])
    scores = table_rows(capsys.readouterr().out)
    assert {task for task, _ in scores} == set(OFFLINE_FILES)
    model, tokenizer = stories
    for task, (_, split) in OFFLINE_FILES.items():
        docs = load_offline(task)[split].select(range(LIMIT))
        hits = 0
        for doc in docs:
            pairs, gold = prompts(task, doc)
            values = [logprob(model, tokenizer, c, x) for c, x in pairs]
            hits += max(range(len(values)), key=values.__getitem__) == gold
        assert scores[(task, "acc")] == pytest.approx(hits / LIMIT, abs=1e-9), task


@needs_data
def test_offline_rows_are_the_whole_splits(monkeypatch):
    monkeypatch.setenv(harness.EVAL_DATA_ENV, str(EVALS))
    for task, (_, split) in OFFLINE_FILES.items():
        assert len(load_offline(task)[split]) == ROWS[task], task
    first = load_offline("hellaswag_offline")["validation"][0]  # lm-eval's preprocessing of the first row
    raw = json.loads((EVALS / "hellaswag" / "hellaswag_val.jsonl").read_text().splitlines()[0])
    assert first["query"].startswith(raw["activity_label"] + ": ") and len(first["choices"]) == 4


def test_missing_data_folder_is_named_before_any_model_loads(monkeypatch, tmp_path):
    monkeypatch.delenv(harness.EVAL_DATA_ENV, raising=False)
    monkeypatch.setattr("hf_attn_patch.models.pretrained.load_source", lambda s: pytest.fail("model loaded"))
    with pytest.raises(SystemExit, match=r"piqa_offline read local files: give their folder with --eval-data DIR"):
        cli.main(["eval", "default", "--tasks", "piqa_offline"])
    (tmp_path / "piqa").mkdir()
    with pytest.raises(SystemExit, match=r"lacks .*piqa/lmeval_validation.jsonl, .*arc_easy/lmeval_test.jsonl"):
        cli.main(["eval", "default", "--tasks", "piqa_offline,arc_easy_offline", "--eval-data", str(tmp_path)])


def test_task_yamls_name_no_data_path():
    yamls = sorted(offline_tasks_dir().glob("*.yaml"))
    assert {p.stem for p in yamls} == set(OFFLINE_FILES)
    for path in yamls:
        text = path.read_text()
        assert "shared" not in text and "data_files" not in text and "custom_dataset: !function data." in text
