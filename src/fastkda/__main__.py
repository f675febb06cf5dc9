"""``python -m fastkda``: the ``fastkda`` command (see fastkda.cli)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
