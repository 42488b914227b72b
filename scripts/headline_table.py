"""Print the headline table of a bench.json (the README's results table is this output).

    python scripts/headline_table.py docs/bench-engines/bench.json
"""

import json
import sys
from pathlib import Path

from loopspec.runtime.bench.headline import headline_table

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/headline_table.py BENCH_JSON")
    print(headline_table(json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))))
