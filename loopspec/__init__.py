"""loopspec: lossless speculative decoding with DFlash block-diffusion drafters and DLoop."""

__version__ = "0.1.0"
