"""Lightning tasks built on the models: image classification and binary segmentation (modules and data)."""

from lightning_gpipe.tasks.classifier import AmoebaNetClassifier, ImageClassifier, load_backbone_weights
from lightning_gpipe.tasks.data import ImageDataModule
from lightning_gpipe.tasks.segmentation import Segmenter, UNetSegmenter
from lightning_gpipe.tasks.shapes import ShapesDataModule, draw_shapes

__all__ = [
    "AmoebaNetClassifier",
    "ImageClassifier",
    "ImageDataModule",
    "Segmenter",
    "ShapesDataModule",
    "UNetSegmenter",
    "draw_shapes",
    "load_backbone_weights",
]
