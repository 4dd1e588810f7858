"""hf-attn eval MODEL --tasks: lm-eval on a local task (tests/data/lm_eval), a converted model beside its source.

The accuracy in the table is checked against our own loglikelihood argmax over the task's choices, computed with
the same context / continuation split as lm-eval's HF model (continuation = enc(context + " " + choice) after
enc(context)), so the command cannot pass by printing any number.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_attn_patch import cli
from hf_attn_patch.converters.convert import convert
from hf_attn_patch.models import load_default

from ._fast import FAST

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install hf-attn-patch[eval])")

TASKS = Path(__file__).parent / "data" / "lm_eval"
DOCS = [json.loads(line) for line in (TASKS / "tiny_stories_cloze.jsonl").read_text().splitlines()]


def our_accuracy(model, tokenizer, docs) -> float:
    """Share of docs whose label has the highest summed log-probability of its continuation tokens."""
    hits = 0
    for doc in docs:
        context = tokenizer(doc["context"], add_special_tokens=False).input_ids
        scores = []
        for choice in doc["choices"]:
            whole = tokenizer(doc["context"] + " " + choice, add_special_tokens=False).input_ids
            with torch.no_grad():
                logp = model(torch.tensor([whole])).logits[0].log_softmax(-1)
            cont = range(len(context), len(whole))
            scores.append(sum(float(logp[i - 1, whole[i]]) for i in cont))
        hits += max(range(len(scores)), key=scores.__getitem__) == doc["label"]
    return hits / len(docs)


def table_rows(output: str) -> dict[str, list[float]]:
    """{metric: [model value, reference value, difference]} from the printed table (columns: 2+ spaces apart)."""
    rows = [re.split(r"\s{2,}", line.strip()) for line in output.strip().splitlines()[2:]]
    return {r[1]: [float(cell.split()[0]) for cell in r[2:]] for r in rows}


def test_tasks_side_by_side_with_the_reference(tmp_path, capsys):
    convert(
        "default", tmp_path / "mqa", to="mqa", method="mean", **FAST
    )  # the baseline merge: far worse than the source
    limit = 8
    cli.main(
        [
            "eval",
            str(tmp_path / "mqa"),
            "--tasks",
            "tiny_stories_cloze",
            "--limit",
            str(limit),
            "--include-path",
            str(TASKS),
            "--reference",
            "default",
        ]
    )
    out = capsys.readouterr().out
    header = out.strip().splitlines()[0].split()
    assert header == ["task", "metric", str(tmp_path / "mqa"), "default", "difference"]
    converted, source, difference = table_rows(out)["acc"]
    model, tokenizer = load_default()
    mqa = AutoModelForCausalLM.from_pretrained(tmp_path / "mqa").eval()
    assert source == pytest.approx(our_accuracy(model, tokenizer, DOCS[:limit]), abs=1e-9)
    assert converted == pytest.approx(our_accuracy(mqa, tokenizer, DOCS[:limit]), abs=1e-9)
    assert difference == pytest.approx(converted - source, abs=1e-4)


def test_unknown_task_fails_before_any_model_loads(monkeypatch):
    def refuse(source):
        raise AssertionError(f"load_source({source!r}) ran before the task names were checked")

    monkeypatch.setattr("hf_attn_patch.models.pretrained.load_source", refuse)
    with pytest.raises(
        SystemExit, match=r"unknown lm-eval task\(s\): 'tiny_stories_clozee' \(did you mean tiny_stories_cloze"
    ):
        cli.main(["eval", "default", "--tasks", "tiny_stories_clozee", "--include-path", str(TASKS)])


def test_missing_lm_eval_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval.tasks", None)  # import lm_eval.tasks now raises ImportError
    monkeypatch.setattr("hf_attn_patch.models.pretrained.load_source", lambda s: pytest.fail("model loaded"))
    with pytest.raises(SystemExit, match=r"pip install 'hf-attn-patch\[eval\]'"):
        cli.main(["eval", "default", "--tasks", "hellaswag"])


def test_text_or_tasks_exactly_one():
    with pytest.raises(SystemExit, match="exactly one of --text FILE"):
        cli.main(["eval", "default"])
    with pytest.raises(SystemExit, match="exactly one of --text FILE"):
        cli.main(["eval", "default", "--text", "x.txt", "--tasks", "hellaswag"])
