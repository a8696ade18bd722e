"""dflash-local: lossless block-diffusion speculative decoding on your own machine."""

__version__ = "0.1.0"
