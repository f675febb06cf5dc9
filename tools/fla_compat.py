"""fla-core's own KDA tests (its repository's tests/ops/test_kda.py, which the wheel does not ship)
run against fastkda's operators, fla's references as judge:

    python tools/fla_compat.py PATH/TO/test_kda.py [pytest args...]

fla's entry points are routed to fastkda's (fastkda.compat) before pytest imports the file, so
every ``chunk_kda`` / ``fused_recurrent_kda`` / gate call in it runs fastkda. Needs fla-core and a
CUDA device (the file's tensors live on fla's device)."""

import sys

import pytest

from fastkda import compat


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    replaced = compat.route_fla_kda()
    print(f"fla's KDA entry points routed to fastkda ({replaced} names)")
    return pytest.main(["-p", "no:cacheprovider", "-q", "-rfE", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
