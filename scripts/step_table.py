"""Print the step table docs/benchmarks.md quotes: a step grid of ours (`scripts/step_times.py --json`,
with the peers it timed in the same run) beside ONNX Runtime GenAI's step curve from separate runs
(`scripts/genai_step.py --curve --json`, none or more).

    python scripts/step_table.py docs/runs/2026-12-05/steps-gguf-int8act.json \
        docs/runs/2026-12-05/genai-int4-a.json docs/runs/2026-12-05/genai-int4-b.json
"""

import argparse
import json
from pathlib import Path

from loopspec.runtime.bench.headline import step_table


def read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("ours", type=Path, help="scripts/step_times.py --json output")
    parser.add_argument("genai", type=Path, nargs="*", help="scripts/genai_step.py --curve --json outputs")
    args = parser.parse_args()
    print(step_table(read(args.ours), [read(path) for path in args.genai]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
