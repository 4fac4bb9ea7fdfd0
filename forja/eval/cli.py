"""`forja eval`: score a run's newest intact checkpoint, or a Hugging Face directory, on task files.

    forja eval runs/default --task python_mc --task python_text        (the shipped samples, by name)
    forja eval hf_dir/ --task tasks/python-text.jsonl --limit 100 --json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from forja.errors import ForjaError
from forja.eval.score import evaluate
from forja.eval.tasks import MULTIPLE_CHOICE, load_task
from forja.generate import add_model_options
from forja.models.quantize import cast, quantize, weight_bytes


def load_model(source: str | Path, *, device: str = "cpu"):
    """(model in eval mode, tokenizer, prefix token id) of a forja run/checkpoint or a Hugging Face dir.

    The prefix token starts every scored sequence, as a document starts (`document_start`: a
    forja run's end-of-document token, a Hugging Face model's BOS), and a model without a
    BOS gets its end-of-text token, as lm-evaluation-harness does: the first token of a
    text needs a token before it to be scored.
    """
    from forja.checkpoint.export import document_start, load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(source, device=device)
    start = document_start(source, tok)
    return model.eval(), tok, start if start is not None else tok.eos_id


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="score a model on downstream task files",
                       description="Multiple-choice accuracy and perplexity / bits per byte on JSONL task "
                                   "files (see docs/evaluation.md).")
    p.add_argument("source", help="a forja run directory (its newest intact checkpoint), a checkpoint, "
                                  "or a Hugging Face model directory")
    p.add_argument("--task", action="append", required=True, metavar="FILE_OR_NAME",
                   help="a JSONL task file, or a task's name (looked up in $FORJA_TASK_PATH, then among the "
                        "samples shipped with forja: python_mc, python_text); repeat for several")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="score only each task's first N examples")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    add_model_options(p)
    p.set_defaults(func=_run_cli)


def add_lm_eval_cli(sub: argparse._SubParsersAction) -> None:
    """`forja lm-eval <lm_eval args>` (forja/eval/harness.py): every argument goes to lm_eval's own
    CLI untouched (prefix_chars of NUL: this parser reads no option of its own, so --model and
    -h reach lm_eval). lm_eval is imported only when the command runs."""
    p = sub.add_parser("lm-eval", help="run lm-evaluation-harness tasks, with the model 'forja'", add_help=False,
                       prefix_chars="\0", description="Run lm-evaluation-harness with forja's model registered as "
                       "'forja' (docs/evaluation.md); `forja lm-eval -h` prints lm_eval's own options.")
    p.add_argument("args", nargs=argparse.REMAINDER,
                   help="lm_eval's own arguments, passed on untouched, e.g. --model forja --model_args pretrained=RUN")
    p.set_defaults(func=_run_lm_eval)


def _run_lm_eval(args: argparse.Namespace) -> int:
    from forja.eval.harness import main  # without lm_eval: one ForjaError naming the extra to install

    return main(args.args)


def _print_table(results: list[dict]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(title="forja eval", box=box.SIMPLE_HEAD, pad_edge=False)  # no vertical rules: fits in 80 columns
    for column in ("task", "kind", "n", "acc", "acc_norm", "ppl", "bits/byte"):
        # Nothing folds: in an 80-column terminal a folded name or figure is hard to read or grep.
        table.add_column(column, justify="left" if column in ("task", "kind") else "right", no_wrap=True,
                         min_width=len(column))
    for r in results:
        if r["kind"] == MULTIPLE_CHOICE:
            table.add_row(r["task"], r["kind"], str(r["n"]), f"{r['acc']:.4f}", f"{r['acc_norm']:.4f}", "", "")
        else:
            table.add_row(r["task"], r["kind"], str(r["n"]), "", "", f"{r['ppl']:.4f}", f"{r['bits_per_byte']:.4f}")
    Console().print(table)


def _run_cli(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise ForjaError(f"--limit {args.limit} must be at least 1 (or left out to score every example)")
    # Every task file is read and checked before the model is loaded: a bad line fails at once.
    tasks = [load_task(path, limit=args.limit) for path in args.task]
    model, tok, prefix = load_model(args.source, device=args.device)
    model = quantize(cast(model, args.dtype), args.quantize)
    results = [evaluate(model, tok, task, prefix_id=prefix, batch_size=args.batch_size) for task in tasks]
    if args.json:
        print(json.dumps({"source": str(args.source), "dtype": args.dtype, "quantize": args.quantize,
                          "weight_bytes": weight_bytes(model),
                          "tasks": results}, indent=2))
    else:
        _print_table(results)
    return 0
