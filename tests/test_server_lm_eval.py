"""Acceptance: lm-evaluation-harness's own `local-completions` model against our server gives the same scores as
its `hf` model on the same weights, for a multiple-choice (loglikelihood: echo + logprobs) task and a
generate_until task (stop strings), with tokenized (token-id prompts) and untokenized (text prompts) requests.
The tasks and data are local (tests/data/lm_eval); nothing comes from the Hub."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_attn_patch.engine import Engine
from hf_attn_patch.models.pretrained import DEFAULT_MODEL_DIR, load_default

from ._server import running

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402

TASKS = Path(__file__).parent / "data" / "lm_eval"
# Per-choice loglikelihood, engine vs transformers fp32: ~10 tokens x the 1e-4 per-token bound of test_server.py.
LOGLIKELIHOOD_ATOL = 1e-3


def _evaluate(model: str, model_args: str):
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(TASKS)  # the task YAMLs name their jsonl files relative to this folder
        return lm_eval.simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=["stories_mc", "stories_gen"],
            task_manager=TaskManager(include_path=str(TASKS)),
            batch_size=1,
            device="cpu",
            log_samples=True,
            random_seed=0,
            numpy_random_seed=0,
            torch_random_seed=0,
            fewshot_random_seed=0,
        )


def _responses(result, task):
    return [s["filtered_resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


@pytest.fixture(scope="module")
def reference(one_torch_thread):
    return _evaluate("hf", f"pretrained={DEFAULT_MODEL_DIR},dtype=float32")


@pytest.mark.parametrize("tokenized", [True, False])
def test_local_completions_matches_hf(reference, tokenized, one_torch_thread):
    model, tok = load_default()
    with running(Engine(model, tok, block_size=8)) as (port, _):
        args = (
            f"model=stories260k,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={DEFAULT_MODEL_DIR},"
            f"tokenizer_backend=huggingface,tokenized_requests={tokenized},max_length=512,num_concurrent=2,"
            f"max_retries=1"
        )
        ours = _evaluate("local-completions", args)
    for task, metric in (
        ("stories_mc", "acc,none"),
        ("stories_mc", "acc_norm,none"),
        ("stories_gen", "exact_match,none"),
    ):
        assert ours["results"][task][metric] == reference["results"][task][metric], (task, metric)
    assert 0 < reference["results"]["stories_gen"]["exact_match,none"] < 1  # the task can tell outputs apart
    for mine, theirs in zip(_responses(ours, "stories_mc"), _responses(reference, "stories_mc")):
        for (ll, greedy), (ll_ref, greedy_ref) in zip(mine, theirs):
            assert abs(ll - ll_ref) < LOGLIKELIHOOD_ATOL and greedy == greedy_ref
    for mine, theirs in zip(_responses(ours, "stories_gen"), _responses(reference, "stories_gen")):
        assert mine[0].lstrip() == theirs[0].lstrip()  # hf decodes the continuation alone: no leading space
