"""`forja tokenizer train|info` and `forja prepare`.

Imports stay inside the handlers: `forja --help` should not pay for tokenizers or numpy.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from forja.errors import ForjaError


def add_tokenizer_cli(subparsers: Any) -> None:
    parser = subparsers.add_parser("tokenizer", help="train or inspect a tokenizer",
                                   description="Train a byte-level BPE tokenizer on a source, or print what "
                                               "a tokenizer.json holds (docs/data.md).")
    commands = parser.add_subparsers(dest="tokenizer_command", metavar="ACTION", required=True)

    train = commands.add_parser("train", help="train a byte-level BPE tokenizer on a source",
                                description="Train a byte-level BPE tokenizer on a source and write its "
                                            "tokenizer.json.")
    train.add_argument("--source", required=True, help="source spec: path/glob, jsonl:, parquet:, hf:, stdlib")
    train.add_argument("--vocab-size", type=int, required=True, help="tokens in the vocabulary, specials included")
    train.add_argument("--out", required=True, help="tokenizer.json to write (or a directory to write it in)")
    train.add_argument("--min-frequency", type=int, default=2, help="least count of a pair to merge (default 2)")
    train.add_argument("--skip-bad-lines", action="store_true", help="skip and count bad JSONL lines or records")
    train.add_argument("--overwrite", action="store_true", help="replace the tokenizer.json at --out if there is one")
    train.set_defaults(func=_tokenizer_train)

    info = commands.add_parser("info", help="print a tokenizer's vocabulary size, special tokens, fingerprint",
                               description="Print a tokenizer's vocabulary size, special tokens and fingerprint.")
    info.add_argument("path", help="tokenizer.json, or a directory holding one")
    info.set_defaults(func=_tokenizer_info)


def add_prepare_cli(subparsers: Any) -> None:
    from_doc = "tokenize a source into shards for training (see docs/data.md)"
    # No abbreviations: --part must never be read as --parts (nor --work as --workers).
    parser = subparsers.add_parser("prepare", help=from_doc, description=from_doc, allow_abbrev=False)
    parser.add_argument("--source", required=True,
                        help='source spec, or a mixture like "stdlib:0.7,jsonl:x.jsonl:0.3"')
    parser.add_argument("--tokenizer", required=True, help="tokenizer.json, or a directory holding one")
    parser.add_argument("--out", required=True, help="directory to create")
    parser.add_argument("--val-fraction", type=float, default=None,
                        help="share of documents for the validation split, chosen by a hash of each (default 0.01)")
    parser.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: every core)")
    parser.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard file (default 2^27)")
    parser.add_argument("--skip-bad-lines", action="store_true", help="skip and count bad JSONL lines or records")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument("--no-progress", action="store_true", help="no live progress line")
    parser.add_argument("--part", type=int, default=None, metavar="K",
                        help="on many machines: tokenize only share K (0 to N-1) into OUT/.parts/ (needs --parts)")
    parser.add_argument("--parts", type=int, default=None, metavar="N", help="the number of shares (workers)")
    parser.add_argument("--merge", action="store_true",
                        help="write OUT from its finished parts, exactly as one `forja prepare` would")
    parser.set_defaults(func=_prepare)


def _tokenizer_train(args: argparse.Namespace) -> int:
    from forja.data.corpus.tokenizer import tokenizer_file, train_tokenizer

    target = tokenizer_file(args.out)
    if target.exists() and not args.overwrite:  # data prepared with it would no longer match it
        raise ForjaError(f"--out {args.out}: {target} already exists; pass --overwrite to replace it "
                         "(data prepared with it then needs preparing again), or give another --out")
    started = time.perf_counter()
    tok = train_tokenizer(args.source, vocab_size=args.vocab_size, out=args.out,
                          min_frequency=args.min_frequency, skip_bad_lines=args.skip_bad_lines)
    print(f"trained a tokenizer of {tok.vocab_size:,} tokens on {args.source} in "
          f"{time.perf_counter() - started:.1f} s -> {args.out} (fingerprint {tok.fingerprint[:12]})")
    return 0


def _tokenizer_info(args: argparse.Namespace) -> int:
    from forja.data.corpus.tokenizer import load_tokenizer

    tok = load_tokenizer(args.path)
    print(f"vocab_size  {tok.vocab_size}")
    for role, token_id in (("bos", tok.bos_id), ("eos", tok.eos_id), ("pad", tok.pad_id)):
        shown = "none" if token_id is None else f"{token_id} {tok.backend.id_to_token(token_id)!r}"
        print(f"{role}_id      {shown}")
    print(f"fingerprint {tok.fingerprint}")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from forja.data.corpus.mixture import Mixture
    from forja.data.corpus.parts import PartDone
    from forja.data.corpus.prepare import prepare

    options = {k: v for k, v in (("val_fraction", args.val_fraction), ("workers", args.workers),
                                 ("shard_tokens", args.shard_tokens)) if v is not None}
    started = time.perf_counter()
    result = prepare(args.source, args.tokenizer, args.out, skip_bad_lines=args.skip_bad_lines,
                     overwrite=args.overwrite, progress=not args.no_progress, part=args.part, parts=args.parts,
                     merge=args.merge, **options)
    seconds = time.perf_counter() - started
    if isinstance(result, PartDone):
        print(f"wrote part {result.part} of {result.parts} ({result.path}): {result.documents:,} documents, "
              f"{result.tokens:,} tokens in {result.seconds:.1f} s, "
              f"{result.tokens / max(result.seconds, 1e-9):,.0f} tokens/s")
        return 0
    datasets = result.datasets if isinstance(result, Mixture) else (result,)
    for dataset in datasets:
        print(_summary(dataset.meta))
    tokens = sum(d.num_tokens("train") + d.num_tokens("val") for d in datasets)
    done = "merged the parts into" if args.merge else "wrote"
    print(f"{done} {args.out}: {tokens:,} tokens in {seconds:.1f} s, {tokens / max(seconds, 1e-9):,.0f} tokens/s")
    return 0


def _summary(meta: dict[str, Any]) -> str:
    splits, source = meta["splits"], meta["source"]
    line = (f"{source['spec']}: {source['documents']:,} documents "
            f"(train {splits['train']['documents']:,} documents / {splits['train']['tokens']:,} tokens, "
            f"val {splits['val']['documents']:,} / {splits['val']['tokens']:,}), {meta['dtype']}")
    notes = [f"{source[k]:,} {label}" for k, label in (
        ("skipped_binary", "binary files skipped"), ("replaced_utf8", "documents with invalid UTF-8 replaced"),
        ("skipped_bad_lines", "bad lines skipped")) if source[k]]
    line += f"; {', '.join(notes)}" if notes else ""
    if splits["val"]["documents"] == 0:  # training validates by default: say so now, not at train time
        why, fix = (("--val-fraction 0", "prepare it with a --val-fraction above 0") if not meta["val_fraction"] else
                    ("a single document, which went to training", "add documents so that one goes to validation"))
        line += f"\nno validation split ({why}): train on it with train.val_interval = 0, or {fix}"
    return line
