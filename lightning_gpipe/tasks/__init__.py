"""Lightning tasks built on the models: image classification (module and data)."""

from lightning_gpipe.tasks.classifier import AmoebaNetClassifier, ImageClassifier, load_backbone_weights
from lightning_gpipe.tasks.data import ImageDataModule

__all__ = ["AmoebaNetClassifier", "ImageClassifier", "ImageDataModule", "load_backbone_weights"]
