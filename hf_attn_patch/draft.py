"""`hf-attn draft MODEL OUT`: build a drafter for speculative decoding from MODEL alone
(converters/drafting/). Imports the builder when it runs."""

from __future__ import annotations

import json


def add_draft_parser(sub, positive_int) -> None:
    """The `draft` subcommand on the CLI's subparsers (`positive_int`: the CLI's argument type)."""
    dr = sub.add_parser(
        "draft",
        help="build a drafter for speculative decoding from MODEL alone (trained on its "
        "own samples); use it as generate(..., assistant_model=AutoModelForCausalLM.from_pretrained(OUT))",
    )
    dr.add_argument("source", metavar="MODEL", help="model folder (safetensors), 'default', 'smollm2' or a Hub id")
    dr.add_argument("out", metavar="OUT")
    dr.add_argument("--samples", type=positive_int, help="teacher samples of MODEL to train on (default 256)")
    dr.add_argument("--length", type=positive_int, help="tokens per sample, prompt included (default 224)")
    dr.add_argument(
        "--draft-vocab", type=positive_int, help="tokens the drafter scores: MODEL's most sampled (default 8192)"
    )
    dr.add_argument("--steps", type=positive_int, help="training steps (default 200)")
    dr.add_argument("--rows", type=positive_int, help="samples per training step (default 6)")
    dr.add_argument("--depth", type=positive_int, help="draft steps unrolled in training (default 2)")
    dr.add_argument(
        "--calib-data",
        help="text the prompts are cut from: a file, folder or dataset (default: the packaged TinyStories sample)",
    )
    dr.add_argument("--seed", type=int)
    dr.add_argument("--overwrite", action="store_true", default=None)
    dr.set_defaults(func=cmd_draft)


def cmd_draft(args) -> None:
    from .converters.drafting import build_drafter

    options = {k: v for k, v in vars(args).items() if k not in ("command", "func", "source", "out") and v is not None}
    try:
        report = build_drafter(args.source, args.out, **options)
    except (ValueError, FileExistsError) as err:
        raise SystemExit(f"error: {err}")
    print(f"wrote {args.out}")
    print(json.dumps(report, indent=2))
