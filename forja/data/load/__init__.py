"""The loading side of forja.data: prepared data (forja.data.corpus) read into batches (torch).

It may import the corpus side, never the reverse. Its floors, lowest first:

    order.py, cursor.py      seeded permutations and the interleaving of sources; a segment's positions
    packing.py, stages.py    a split cut into samples (window, bos, best-fit); data stages
    batch.py, windows.py     the micro-batch; unshuffled windows for validation
    loader.py                the deterministic, resumable, rank-sharded training loader
"""
