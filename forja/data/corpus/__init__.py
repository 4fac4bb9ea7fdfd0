"""The preparation side of forja.data, torch-free: a corpus from its sources to token shards.

`forja prepare`'s worker processes import only this side (and numpy, tokenizers), never torch;
tests/unit/data/test_sides.py checks it. Its floors, lowest first:

    source_base.py, records.py, sources.py  what a source is; its records (jsonl, parquet, hf); the registry
    remote.py, shards.py, mixture.py        token shards on disk or an object store (read by ranges); mixtures
    tokenizer.py, encoding.py               byte-level BPE; documents tokenized in parallel, split by hash
    store.py, progress.py                   prepared data put on an object store; prepare's progress display
    parts.py, prepare.py                    `--part K --parts N` workers and `--merge`; prepare, cached by content
    cli.py                                  `forja prepare`, `forja tokenizer`
"""
