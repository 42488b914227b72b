"""A training campaign (`loopspec train --campaign FILE`): one JSON file that every run of a long,
restarted training appends its record to, so that the whole history — which command ran on which
data, how far each run got, the CPU it cost and the held-out τ it measured — is in one place after
any number of restarts.

The file is {"kind": CAMPAIGN_KIND, "runs": [record, ...]}. A run writes its record when it starts,
rewrites it at every checkpoint (so a killed run's record says how far its checkpoint got, which is
where the next run resumes) and when it ends ("finished": true). Each write re-reads the file and
replaces it whole (a temporary file renamed over it): records other runs added meanwhile stay, and
a kill mid-write leaves the previous file, not half of one.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

from loopspec.errors import LoopspecError
from loopspec.files import file_sha256

CAMPAIGN_KIND = "loopspec-training-campaign"


def read_campaign(path: Path) -> list[dict]:
    """The runs a campaign file holds ([] for a missing or empty file); anything else is refused."""
    if not path.is_file() or path.stat().st_size == 0:
        return []
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoopspecError(f"{path} is not a training campaign file (not JSON: {e}); name a new --campaign") from None
    if not isinstance(data, dict) or data.get("kind") != CAMPAIGN_KIND or not isinstance(data.get("runs"), list):
        raise LoopspecError(
            f'{path} is not a training campaign file (no "kind": "{CAMPAIGN_KIND}" with a runs list); '
            "name a new --campaign"
        )
    return data["runs"]


class Campaign:
    """One run's record in a campaign file. `command`: the command line as run (["loopspec", "train", ...])."""

    def __init__(self, path: str | Path, command: list[str]):
        self.path = Path(path)
        read_campaign(self.path)  # a file that is not a campaign is refused before the run loads anything
        self.cpu_start, self.wall_start = time.process_time(), time.time()
        self.record = {
            "id": uuid.uuid4().hex,  # finds this run's record again among the others
            "command": list(command),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "finished": False,
        }

    def begin(self, *, data_dir: Path, out_dir: Path, step: int, total_steps: int, config: dict) -> None:
        """Write the record of a run that starts (or resumes) at `step` of a `total_steps` schedule."""
        samples = Path(data_dir) / "samples.jsonl"
        self.record.update(
            {
                # the samples' bytes name the data: a data directory regenerated or grown is other data
                "data": {"path": str(Path(data_dir).resolve()), "samples_sha256": file_sha256(samples)},
                "out": str(Path(out_dir).resolve()),
                "config": config,
                "steps": {"from": step, "to": step, "schedule": total_steps},
                "curve": [],
            }
        )
        self._write()

    def update(self, *, step: int, curve: list[dict], finished: bool = False) -> None:
        """Rewrite the record: the run's checkpoint is at `step`; `curve` its held-out τ rows so far."""
        self.record["steps"]["to"] = step
        self.record["curve"] = curve
        self.record["finished"] = finished
        self._write()

    def _write(self) -> None:
        # CPU seconds of this process (every thread's), the cost a CPU campaign budgets
        self.record["cpu_s"] = round(time.process_time() - self.cpu_start, 1)
        self.record["wall_s"] = round(time.time() - self.wall_start, 1)
        runs = read_campaign(self.path)
        mine = [i for i, r in enumerate(runs) if isinstance(r, dict) and r.get("id") == self.record["id"]]
        if mine:
            runs[mine[0]] = self.record
        else:
            runs.append(self.record)
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.partial")
        temporary.write_text(json.dumps({"kind": CAMPAIGN_KIND, "runs": runs}, indent=1) + "\n")
        temporary.replace(self.path)
