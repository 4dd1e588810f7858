"""`hf-attn`: the command line. Subcommands import what they need lazily."""

from __future__ import annotations

import argparse
import os
import sys

from .demo import cmd_demo
from .draft import add_draft_parser
from .extras import MissingExtraError, require

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # as vLLM: the rest is left to the CUDA context, other processes and fragmentation


def _load_config(source: str):
    """A config from a model folder, a config.json file, 'default' (the embedded model) or a Hub id."""
    import json
    from pathlib import Path

    from transformers import AutoConfig

    from .models.pretrained import DEFAULT_MODEL_DIR

    if source == "default":
        return AutoConfig.from_pretrained(DEFAULT_MODEL_DIR)
    path = Path(source)
    if path.is_file():
        data = json.loads(path.read_text())
        if "model_type" not in data:
            raise SystemExit(f"error: {source} has no model_type: not a transformers config.json")
        return AutoConfig.for_model(**data)
    if path.is_dir() and not (path / "config.json").exists():
        raise SystemExit(f"error: {source} is a folder without config.json")
    try:
        return AutoConfig.from_pretrained(source)
    except OSError as err:
        raise SystemExit(
            f"error: MODEL_OR_CONFIG={source!r} is neither a local model/config nor a reachable Hub id ({err})"
        )


def cmd_push(args) -> None:
    import json

    from .hub import push

    try:
        result = push(args.folder, args.repo, private=args.private, dry_run=args.dry_run)
    except ValueError as err:
        raise SystemExit(f"error: {err}")
    print(json.dumps(result, indent=2))


def cmd_eval(args) -> None:
    import json

    from .models.pretrained import load_source
    from .evaluation.perplexity import evaluate, read_text, windows_of

    if (args.text is None) == (args.tasks is None):
        raise SystemExit("error: eval needs exactly one of --text FILE (perplexity) and --tasks T[,T...] (lm-eval)")
    if args.long_context and (args.text is None or args.reference is None):
        raise SystemExit(
            "error: --long-context needs --text FILE (the text it cuts passages from) and --reference "
            "SRC (the shares are of the reference's accuracy)"
        )
    if args.update_card and (
        args.reference is None or not os.path.isfile(os.path.join(args.model, "conversion_report.json"))
    ):
        raise SystemExit(
            "error: --update-card needs --reference SRC and MODEL a converted folder (with conversion_report.json)"
        )
    if args.tasks is not None:
        return _eval_tasks(args)
    try:
        text = read_text(args.text)
        model, tokenizer = load_source(args.model)
        reference = load_source(args.reference)[0] if args.reference else None
        windows = windows_of(text, tokenizer, args.ctx, args.max_tokens)
        result = evaluate(model, windows, reference)
        extra = {}
        if args.long_context:  # repeated passages and fact recall 1K-4K back, as shares of the reference's
            from .evaluation.passage import long_context

            found = long_context(model, reference, tokenizer, text, items=args.long_context_items)
            extra["long_context"] = {"text": os.path.basename(args.text), **found}
        if args.update_card:  # the source's perplexity on the same windows, recorded beside the model's
            from .hub import update_card

            source_ppl = evaluate(reference, windows, progress=False).perplexity
            update_card(
                args.model,
                {
                    "text": os.path.basename(args.text),
                    "tokens": result.tokens,
                    "perplexity": result.perplexity,
                    "source_perplexity": source_ppl,
                    "kl_to_reference": result.kl_to_reference,
                    **extra,
                },
            )
    except ValueError as err:
        raise SystemExit(f"error: {err}")
    print(
        json.dumps({"model": args.model, "reference": args.reference, "text": args.text, **result.to_dict(), **extra})
    )


def _eval_tasks(args) -> None:
    """lm-eval tasks on MODEL (and --reference), one table; lm-eval and the task names are checked before loading."""
    from .models.pretrained import load_source
    from .evaluation.harness import EVAL_DATA_ENV, check_eval_data, check_tasks, run_tasks, table, task_manager

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:
        manager = task_manager(args.include_path)
        check_tasks(tasks, manager)
        if args.eval_data:  # read by the offline tasks' loaders (assets/lm_eval_tasks)
            os.environ[EVAL_DATA_ENV] = os.path.abspath(args.eval_data)
        check_eval_data(tasks, os.environ.get(EVAL_DATA_ENV))
        scores = {}
        for name in [args.model] + ([args.reference] if args.reference else []):
            model, tokenizer = load_source(name)
            scores[name] = run_tasks(
                model,
                tokenizer,
                tasks,
                manager,
                limit=args.limit,
                batch_size=args.batch_size,
                num_fewshot=args.num_fewshot,
            )
            del model
    except ValueError as err:
        raise SystemExit(f"error: {err}")
    reference = scores.get(args.reference) if args.reference else None
    print(table(scores[args.model], reference, names=(args.model, args.reference or "")))
    if args.update_card:  # accuracy beside the reference's, in MODEL's report and model card
        from .hub import update_card

        ref = {(s.task, s.metric): s.value for s in reference}
        accuracy = {
            f"{s.task} {s.metric}": [s.value, ref[s.task, s.metric]]
            for s in scores[args.model]
            if s.metric in ("acc", "acc_norm") and (s.task, s.metric) in ref
        }
        if not accuracy:
            raise SystemExit("error: --update-card: the tasks report no acc / acc_norm metric to record")
        update_card(args.model, {"accuracy": accuracy})


def cmd_convert(args) -> None:
    import json

    from .converters.convert import convert

    try:
        report = convert(args.source, args.out, **convert_options(args))
    except (ValueError, FileExistsError) as err:
        raise SystemExit(f"error: {err}")
    if os.environ.get("RANK", "0") != "0":
        return  # another process of a distributed launch; rank 0 wrote OUT and prints the summary
    summary = {k: report[k] for k in ("format", "kv_bytes_per_token_fp16", "kv_ratio", "wall_time_s", "peak_rss_mb")}
    print(f"wrote {args.out}")
    print(json.dumps(summary, indent=2))


def add_convert_options(parser: argparse.ArgumentParser) -> None:
    """One --flag per conversion option, read from ConvertOptions' field metadata (help, choices, type, flag)."""
    from .converters.options import option_fields

    for name, _, meta in option_fields():
        kwargs = {"dest": name, "help": meta["help"]}
        if meta["flag"] is not None:  # a boolean: --propagate / --no-regroup; unset: convert()'s default
            kwargs.update(action="store_false" if meta["flag"].startswith("--no-") else "store_true", default=None)
        else:
            kwargs.update(
                type=meta["parse"] or str, choices=meta["choices"], metavar=meta["metavar"], required=name == "to"
            )
        parser.add_argument(meta["flag"] or "--" + name.replace("_", "-"), **kwargs)


def convert_options(args) -> dict:
    """The options given on the command line; every other one keeps convert()'s default (one set of defaults)."""
    return {k: v for k, v in vars(args).items() if k not in ("command", "func", "source", "out") and v is not None}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction in (0, 1]")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number >= 0")
    return value


def cmd_kv_report(args) -> None:
    from .kv_memory import dtype_of, kv_report, llama3_8b_configs

    try:
        dtype_of(args.dtype)
    except ValueError as err:
        raise SystemExit(f"error: --dtype: {err}")
    if args.model == "llama3-8b":
        configs = llama3_8b_configs()
    else:
        configs = {args.model: _load_config(args.model)}
    print(kv_report(configs, args.seq_len, args.batch_size, args.dtype))


def cmd_serve(args) -> None:
    require("serve", "hf-attn serve")  # before the model loads
    from .models.pretrained import load_source
    from .devices import resolve_device
    from .engine import Engine
    from .engine.memory import DEFAULT_KV_MEMORY
    from .serving import serve

    if args.gpu_memory_utilization is not None and args.kv_memory is not None:
        raise SystemExit("error: give one of --gpu-memory-utilization and --kv-memory")
    try:
        device = resolve_device(args.device, "--device")
        memory = {"max_memory": args.kv_memory}
        if args.gpu_memory_utilization is not None or (args.kv_memory is None and device.type == "cuda"):
            memory = {"memory_utilization": args.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION}
        elif args.kv_memory is None:
            memory = {"max_memory": DEFAULT_KV_MEMORY}
        model, tokenizer = load_source(args.model)
        engine = Engine(
            model,
            tokenizer,
            max_batch_tokens=args.max_batch_tokens,
            block_size=args.block_size,
            device=str(device),
            dtype=args.dtype,
            **memory,
        )
    except ValueError as err:
        raise SystemExit(f"error: {err}")
    pool = engine.kv_stats()
    weight = next(engine.model.parameters())
    print(
        f"serving {args.model} at http://{args.host}:{args.port}/v1 on {weight.device} in "
        f"{str(weight.dtype).removeprefix('torch.')} ({pool['blocks_total']} KV blocks of {pool['block_size']} "
        f"tokens, {pool['bytes_total'] / 2**20:.0f} MiB; context {engine.max_model_len}; SIGTERM drains for "
        f"{args.drain_timeout:g} s)"
    )
    serve(engine, args.model, args.host, args.port, args.max_queue, args.drain_timeout, args.max_body_bytes)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-attn", description="GQA / MQA / MLA attention for transformers")
    sub = parser.add_subparsers(dest="command", required=True)

    kv = sub.add_parser("kv-report", help="KV-cache bytes of a model or config, and the ratio to MHA")
    kv.add_argument(
        "model",
        metavar="MODEL_OR_CONFIG",
        help="model folder, config.json, 'default', 'llama3-8b' (a Llama-3-8B-shaped example as MHA, MQA, GQA, "
        "MLA) or Hub id",
    )
    kv.add_argument("--seq-len", type=_positive_int, default=4096)
    kv.add_argument("--batch-size", type=_positive_int, default=1)
    kv.add_argument("--dtype", default="float16")
    kv.set_defaults(func=cmd_kv_report)

    cv = sub.add_parser(
        "convert",
        help="convert a checkpoint to GQA / MQA / MLA, optionally healed by distillation (writes OUT atomically)",
    )
    cv.add_argument("source", metavar="SRC", help="model folder (safetensors), 'default', 'smollm2' or a Hub id")
    cv.add_argument("out", metavar="OUT")
    add_convert_options(cv)
    cv.set_defaults(func=cmd_convert)

    ps = sub.add_parser("push", help="upload a converted folder to the Hub (create_repo + upload_folder)")
    ps.add_argument("folder", metavar="OUT")
    ps.add_argument("repo", metavar="REPO", help="owner/name")
    ps.add_argument("--private", action="store_true")
    ps.add_argument("--dry-run", action="store_true", help="list what would be uploaded; upload nothing")
    ps.set_defaults(func=cmd_push)

    ev = sub.add_parser(
        "eval", help="perplexity and KL on a text (JSON), or lm-eval tasks (a table), against a reference"
    )
    ev.add_argument("model", metavar="MODEL", help="model folder, 'default', 'smollm2' or a Hub id")
    ev.add_argument("--text", help="UTF-8 text file: perplexity, and KL per token to --reference (JSON)")
    ev.add_argument(
        "--tasks",
        metavar="T[,T...]",
        help="lm-eval task names (needs hf-attn-patch[eval]): a table of their metrics, beside --reference's",
    )
    ev.add_argument("--limit", type=_positive_int, help="--tasks: examples per task at most (default all)")
    ev.add_argument("--num-fewshot", type=int, help="--tasks: few-shot examples (default: each task's own)")
    ev.add_argument("--batch-size", type=_positive_int, default=1, help="--tasks: lm-eval batch size (default 1)")
    ev.add_argument("--include-path", metavar="DIR", help="--tasks: a folder of extra lm-eval task YAMLs")
    ev.add_argument(
        "--eval-data",
        metavar="DIR",
        help="--tasks: the folder of the offline zero-shot tasks' files "
        "(hellaswag_offline, arc_easy_offline, arc_challenge_offline, piqa_offline, winogrande_offline; "
        "all five: zero_shot_offline); default: $HF_ATTN_EVAL_DATA",
    )
    ev.add_argument(
        "--update-card",
        action="store_true",
        help="with --reference: record the perplexities and KL "
        "(--text) or the accuracies (--tasks) beside the reference's in MODEL's conversion_report.json and "
        "model card (a converted folder)",
    )
    ev.add_argument(
        "--long-context",
        action="store_true",
        help="with --text and --reference: also probe retrieval "
        "from far back in the text (a passage repeated, and a fact recalled, 1,024 / 2,048 / 4,096 tokens "
        "later; the distances that fit the context) and print the model's share of the reference's "
        "accuracy; with --update-card, recorded in the model card",
    )
    ev.add_argument(
        "--long-context-items",
        type=_positive_int,
        default=8,
        metavar="N",
        help="--long-context: items per probe and distance (default 8; more: less noise, longer)",
    )
    ev.add_argument("--ctx", type=_positive_int, default=512, help="tokens per window (default 512)")
    ev.add_argument("--max-tokens", type=_positive_int, default=4096, help="tokens evaluated at most (default 4096)")
    ev.add_argument(
        "--reference",
        metavar="SRC",
        help="reference model: KL(reference || model) with --text, a side-by-side column with --tasks",
    )
    ev.set_defaults(func=cmd_eval)

    sv = sub.add_parser("serve", help="OpenAI-compatible server (continuous batching engine) for a model")
    sv.add_argument(
        "model", metavar="MODEL", help="model folder (e.g. a converted one), 'default', 'smollm2' or a Hub id"
    )
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=_positive_int, default=8000)
    sv.add_argument("--max-batch-tokens", type=_positive_int, default=512, help="tokens per engine step")
    sv.add_argument("--block-size", type=_positive_int, default=16)
    sv.add_argument(
        "--device", default="auto", help="auto (default: the first CUDA GPU if any, else cpu), cpu, cuda, cuda:N"
    )
    sv.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto (default): the checkpoint's dtype; float32 checkpoints run in bfloat16 on a GPU, "
        "half-precision ones in float32 on the CPU",
    )
    sv.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        metavar="F",
        help=f"size the KV cache to fill this share of the device's memory (the machine's RAM on the CPU), "
        f"after the weights and a profiling step at --max-batch-tokens (default on a GPU: "
        f"{DEFAULT_GPU_MEMORY_UTILIZATION})",
    )
    sv.add_argument(
        "--kv-memory",
        "--max-memory",
        type=_positive_int,
        metavar="BYTES",
        help="KV cache bytes instead (default on the CPU: 512 MiB)",
    )
    sv.add_argument("--max-queue", type=_positive_int, default=256, help="requests in flight before 429")
    sv.add_argument(
        "--drain-timeout",
        type=_non_negative_float,
        default=10.0,
        help="seconds in-flight requests may run after SIGTERM before they are aborted (default 10)",
    )
    sv.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=8 * 1024 * 1024,
        help="larger request bodies are refused (413) before parsing (default 8 MiB)",
    )
    sv.set_defaults(func=cmd_serve)

    add_draft_parser(sub, _positive_int)

    demo = sub.add_parser("demo", help="KV tables and a story from the embedded model, stock vs our attention")
    demo.add_argument("--max-new-tokens", type=_positive_int, default=60)
    demo.set_defaults(func=cmd_demo)

    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except MissingExtraError as err:  # one line naming the extra, no traceback
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    sys.exit(main())
