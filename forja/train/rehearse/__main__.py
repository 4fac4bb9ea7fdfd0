"""`python -m forja.train.rehearse WORLD < config.toml`: rehearse a resolved config in a
process of its own (the preflight's `parallel.memory_check = "rehearse"`: a worker already
holds a process group, a rehearsal needs its own fake one) and print its JSON."""

from __future__ import annotations

import json
import sys

import tomllib

from forja.config import config_from_dict
from forja.errors import ForjaError
from forja.train.rehearse.rehearsal import rehearse


def main(argv: list[str]) -> int:
    world = int(argv[0])
    cfg = config_from_dict(tomllib.loads(sys.stdin.read()), "the preflight's config")
    try:
        print(json.dumps(rehearse(cfg, world).as_json()))
    except ForjaError as exc:
        print(json.dumps({"error": str(exc)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
