"""Models built as one ``nn.Sequential`` that a pipeline can split anywhere; plain PyTorch."""

from lightning_gpipe.models.amoebanet import amoebanetd
from lightning_gpipe.models.unet import unet

__all__ = ["amoebanetd", "unet"]
