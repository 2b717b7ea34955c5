"""Models built as one ``nn.Sequential`` that a pipeline can split anywhere; plain PyTorch."""

from lightning_gpipe.models.amoebanet import amoebanetd

__all__ = ["amoebanetd"]
