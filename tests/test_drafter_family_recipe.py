"""The recipe of docs/architecture.md "a drafter family", followed from this one file: a toy family
(a block drafter whose draft step never drafts its anchor again) gets its config and model classes
here and one registry row (loopspec/model/drafters.py `register_drafter_family`); then the pair
loader finds it by its checkpoint's architecture, the torch engine drafts with it through the block
drafters' context (engines/drafter_contexts.py, by its kind's `context`), decoding stays lossless
with drafts accepted, a batch decodes each row as alone, and what was not written for it (an
exported drafter graph) is refused in one line."""

import json
from dataclasses import fields, replace

import pytest
import torch

from conftest import accepted_drafts, agreeing_drafter, batched_greedy_equals_plain, lively
from loopspec.engines.backends import torch_engine
from loopspec.errors import LoopspecError
from loopspec.model.dflash import Drafter, DrafterConfig
from loopspec.model.draft_head import StageDrafts
from loopspec.model.drafter_kinds import ARCHITECTURE
from loopspec.model.drafter_kinds import DRAFTER_KINDS, DrafterKind
from loopspec.model.drafters import DRAFTER_FAMILIES, DrafterFamily, load_drafter, register_drafter_family
from loopspec.pair import load_pair
from loopspec.runtime.decoder import generate
from loopspec.settings import DecodingSettings
from loopspec.weights import load_target_dir

TOY_ARCHITECTURE = "ToyDraftModel"
PROMPTS = [[3, 17, 42, 9, 88, 5], [61, 2, 33, 70, 12], [7, 7, 101, 54, 19, 23, 40]]


# ---- the family: its config, its model, its registry row ------------------------------------------


class ToyConfig(DrafterConfig):
    """A DFlash block drafter's config saved under the toy's architecture."""

    @property
    def kind(self) -> DrafterKind:
        return replace(super().kind, name="toy", family="Toy")  # context "dflash": the block drafters'

    @classmethod
    def from_checkpoint(cls, raw: dict) -> "ToyConfig":
        base = DrafterConfig.from_checkpoint({**raw, "architectures": [ARCHITECTURE]})
        return cls(**{f.name: getattr(base, f.name) for f in fields(DrafterConfig)})

    def to_zlab(self) -> dict:
        return {**super().to_zlab(), "architectures": [TOY_ARCHITECTURE]}


class ToyDrafter(Drafter):
    """DFlash's block forward; its draft step ranks each position's candidates with the anchor's own
    token pushed last (a toy rule: a drafter that never repeats its anchor)."""

    config_class = ToyConfig

    def stage_drafts(self, hidden, anchors, head, draft_ids, sampling=None) -> StageDrafts:
        if sampling is not None:
            raise LoopspecError("the toy drafter drafts greedily only")

        def penalised(states):  # [R, D, H] → logits with each row's anchor last
            logits = head(states).clone()
            logits[torch.arange(len(anchors)), :, anchors] = float("-inf")
            return logits

        return super().stage_drafts(hidden, anchors, penalised, draft_ids)


TOY = DrafterFamily("toy", (TOY_ARCHITECTURE,), ToyDrafter)


@pytest.fixture(scope="module")
def toy_pair(target_dir, tmp_path_factory):
    """The registry row added for this module (and taken out after it), and a toy drafter trained to
    agree with the tiny target, saved under the toy's architecture."""
    register_drafter_family(TOY)
    target = lively(load_target_dir(target_dir))
    cfg = ToyConfig(
        **{
            f.name: getattr(DrafterConfig.for_target(target.cfg, num_layers=1, block_size=6, mask_token_id=127), f.name)
            for f in fields(DrafterConfig)
        }
    )
    trained = agreeing_drafter(target, PROMPTS, cfg, new_tokens=30, steps=60)
    toy = ToyDrafter(cfg)
    toy.load_state_dict(trained.state_dict())
    directory = tmp_path_factory.mktemp("toy") / "drafter"
    toy.save(directory, dtype=torch.float32)
    yield target, directory
    for architecture in TOY.architectures:
        DRAFTER_FAMILIES.pop(architecture, None)


def test_the_registry_loads_the_toy_by_its_architecture(toy_pair, target_dir):
    _, directory = toy_pair
    assert json.loads((directory / "config.json").read_text())["architectures"] == [TOY_ARCHITECTURE]
    drafter = load_drafter(directory)
    assert type(drafter) is ToyDrafter and drafter.cfg.kind.name == "toy" and drafter.cfg.kind.context == "dflash"
    pair = load_pair(target_dir, directory)
    assert type(pair.drafter) is ToyDrafter
    with pytest.raises(LoopspecError, match="already loaded by the dflash family"):
        register_drafter_family(DrafterFamily("copy", (ARCHITECTURE,), ToyDrafter))


def test_an_unknown_architecture_is_refused_naming_the_known_ones(tmp_path, toy_pair):
    _, directory = toy_pair
    raw = json.loads((directory / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "architectures": ["NoSuchDraftModel"]}))
    with pytest.raises(LoopspecError, match=f"NoSuchDraftModel.*{TOY_ARCHITECTURE}"):
        load_drafter(tmp_path)


def test_the_toy_decodes_losslessly_with_drafts_accepted_alone_and_batched(toy_pair):
    target, directory = toy_pair
    engine = torch_engine(target, load_drafter(directory), 256, max_rows=len(PROMPTS))
    settings = DecodingSettings("dflash", block_size=6)
    plain = [generate(engine, p, DecodingSettings(), max_new_tokens=30).tokens for p in PROMPTS]
    drafted = [generate(engine, p, settings, max_new_tokens=30) for p in PROMPTS]
    assert [r.tokens for r in drafted] == plain
    accepted = accepted_drafts(drafted)
    assert accepted >= 20, accepted  # measured 40+ of the 90 tokens: its draft step runs, and is accepted
    # the rule is the toy's: no draft equals its stage's anchor
    stage = engine.draft([0], [PROMPTS[0][-1]], [len(PROMPTS[0])], 6)
    assert PROMPTS[0][-1] not in stage[0][0, :, 0].tolist()
    assert batched_greedy_equals_plain(engine, PROMPTS, settings, new_tokens=30) >= 20


def test_what_was_not_written_for_the_toy_is_refused_in_one_line(toy_pair, target_dir, tmp_path):
    from loopspec.convert.onnx_export import convert_onnx

    target, directory = toy_pair
    with pytest.raises(LoopspecError, match="no drafter graph for Toy drafters: they run on --backend torch") as e:
        convert_onnx(target, load_drafter(directory), tmp_path / "onnx", target_dir=target_dir)
    assert "\n" not in str(e.value)
    assert "toy" not in DRAFTER_KINDS  # the kinds' registry needs no row: the family's config names its kind
