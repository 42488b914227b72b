"""loopspec: lossless speculative decoding with DFlash block-diffusion drafters and DLoop."""

from pathlib import Path as _Path

__version__ = "0.1.0"

# engines/, convert/, runtime/ and cli/ sit beside this directory in a checkout and are mapped to
# loopspec.engines / .convert / .runtime / .cli by pyproject's package-dir when installed. In a checkout
# (its pyproject.toml beside them) they are found from here too, so `PYTHONPATH=<checkout>` runs that
# checkout's code whether or not (and wherever) loopspec is installed.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "runtime" / "__init__.py").is_file():
    __path__.append(str(_checkout))
