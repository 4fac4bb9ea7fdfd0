"""`python -m forja` is the `forja` command (torchrun launches it this way)."""

from forja.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
