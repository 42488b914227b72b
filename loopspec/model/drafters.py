"""The drafter registry: which class loads a drafter checkpoint, by its config.json's architecture.

One `DrafterFamily` row per family, keyed by the architectures its checkpoints name
(`architectures` in config.json). `load_drafter` reads config.json once, looks the class up and
lets it load the rest; `drafter_config` reads a config the same way (an exported artifact's drafter/,
which holds no weights). Nothing else in the project decides a drafter's family: every layer then
asks the loaded config's `kind` (model/drafter_kinds.py).

Adding a family (docs/architecture.md, "a drafter family"): its model file (a config class with
`kind`, `fit` and `from_checkpoint`; a model class with `config_class`, `load` and the calls its
engine context makes), one `DrafterFamily` row here (or `register_drafter_family` from the family's
own module), and, where it drafts differently from a block drafter, its engine contexts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from loopspec.errors import LoopspecError
from loopspec.files import read_json
from loopspec.model.dflash2 import DFlash2Drafter
from loopspec.model.dflash import Drafter
from loopspec.model.drafter_kinds import ARCHITECTURE, DEEPSPEC_ARCHITECTURE, DFLASH2_ARCHITECTURE, EAGLE3_ARCHITECTURE
from loopspec.model.eagle3 import Eagle3Drafter


@dataclass(frozen=True)
class DrafterFamily:
    """One drafter family: the config.json architectures its checkpoints are saved under and the
    class that loads them (`model.load(directory, dtype, raw)`, `model.config_class.from_checkpoint(raw)`)."""

    name: str
    architectures: tuple[str, ...]
    model: type


DRAFTER_FAMILIES: dict[str, DrafterFamily] = {}  # architecture → family


def register_drafter_family(family: DrafterFamily) -> None:
    """Add a family's row; an architecture another family already loads is refused."""
    taken = [a for a in family.architectures if a in DRAFTER_FAMILIES and DRAFTER_FAMILIES[a] != family]
    if taken:
        raise LoopspecError(
            f"drafter architecture {taken[0]} is already loaded by the {DRAFTER_FAMILIES[taken[0]].name} family"
        )
    DRAFTER_FAMILIES.update({architecture: family for architecture in family.architectures})


for _family in (
    DrafterFamily("dflash", (ARCHITECTURE, DEEPSPEC_ARCHITECTURE), Drafter),  # DSpark: DeepSpec's
    DrafterFamily("dflash2", (DFLASH2_ARCHITECTURE,), DFlash2Drafter),
    DrafterFamily("eagle3", (EAGLE3_ARCHITECTURE,), Eagle3Drafter),
):
    register_drafter_family(_family)


def drafter_family(raw: dict, where: str | Path) -> DrafterFamily:
    """The family of a drafter's config.json `raw` (read from `where`), by its architecture."""
    archs = raw.get("architectures") if isinstance(raw, dict) else None
    found = (
        [DRAFTER_FAMILIES[a] for a in archs if isinstance(a, str) and a in DRAFTER_FAMILIES]
        if isinstance(archs, list)
        else []
    )
    if not found:
        known = ", ".join(sorted(DRAFTER_FAMILIES))
        raise LoopspecError(f"{where}: not a drafter loopspec loads: architectures={archs} (expected one of {known})")
    return found[0]


def read_drafter_config(directory: str | Path) -> tuple[dict, DrafterFamily]:
    """A drafter directory's config.json (read once) and its family."""
    directory = Path(directory)
    if not directory.is_dir():
        raise LoopspecError(f"drafter path does not exist or is not a directory: {directory}")
    raw = read_json(directory / "config.json", "drafter config")
    return raw, drafter_family(raw, directory / "config.json")


def load_drafter(directory: str | Path, dtype: torch.dtype = torch.float32):
    """The drafter a directory holds, loaded by its family's class."""
    raw, family = read_drafter_config(directory)
    return family.model.load(directory, dtype, raw=raw)


def drafter_config(directory: str | Path):
    """The config of the drafter a directory describes (its config.json alone: no weights read)."""
    raw, family = read_drafter_config(directory)
    return family.model.config_class.from_checkpoint(raw)
