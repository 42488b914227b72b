"""Print the tables of a bench.json that the README and docs/benchmarks.md quote: the headline (one
line per engine and method, ranges over the sets) or, with --per-set, one column per set.

    python scripts/headline_table.py docs/bench-engines/bench.json [--per-set]
"""

import argparse
import json
from pathlib import Path

from loopspec.runtime.bench.headline import headline_table, per_set_table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("report", type=Path, help="a bench.json (`loopspec bench --out DIR`)")
    parser.add_argument("--per-set", action="store_true", help="one column per prompt set")
    args = parser.parse_args()
    report = json.loads(args.report.read_text(encoding="utf-8"))
    print(per_set_table(report) if args.per_set else headline_table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
