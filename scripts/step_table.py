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

if __name__ == "__main__":
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("ours", type=Path)
    parser.add_argument("genai", type=Path, nargs="*")
    args = parser.parse_args()
    read = lambda path: json.loads(path.read_text(encoding="utf-8"))
    print(step_table(read(args.ours), [read(path) for path in args.genai]))
