"""``ShapesDataModule``: noisy images of discs and rectangles and their masks, drawn offline from a seed.

A segmentation task that needs no download and no file, so a U-Net trains in seconds on a CPU and
every process of a pipeline draws the same images. Each shape is brighter or darker than the
background, which itself has a random level and slope, so no single threshold of the intensity finds
the shapes: the network has to see their edges.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from lightning_gpipe.tasks.data import SplitLoaders

__all__ = ["ShapesDataModule", "draw_shapes"]

SPLITS = ("train", "val", "test")


def draw_shapes(
    count: int, image_size: int = 32, max_shapes: int = 3, noise: float = 0.3, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """``count`` images (``count, 1, image_size, image_size``, float32) and their binary masks (same shape, 0 or 1).

    Each image holds 1 to ``max_shapes`` discs or axis-aligned rectangles, drawn in order (a later one
    covers an earlier one), each with a contrast of 0.6 to 1.2 above or below a background of random
    level and slope, plus Gaussian noise of std ``noise``. The mask is where any shape is. The same
    arguments give the same tensors, on any machine (one ``torch.Generator`` on the CPU draws everything).
    """
    if count < 1 or image_size < 4 or max_shapes < 1:
        raise ValueError(
            "draw_shapes needs count >= 1, image_size >= 4 and max_shapes >= 1; "
            f"got {count}, {image_size}, {max_shapes}."
        )
    if noise < 0:
        raise ValueError(f"`noise` is a standard deviation, >= 0; got {noise}.")
    g = torch.Generator().manual_seed(seed)

    def uniform(low: float, high: float, *shape: int) -> Tensor:
        return low + (high - low) * torch.rand(count, *shape, generator=g)

    ys = (torch.arange(image_size, dtype=torch.float32) + 0.5).view(1, image_size, 1) / image_size
    xs = (torch.arange(image_size, dtype=torch.float32) + 0.5).view(1, 1, image_size) / image_size
    level, slope_y, slope_x = uniform(-0.5, 0.5, 1, 1), uniform(-1.0, 1.0, 1, 1), uniform(-1.0, 1.0, 1, 1)
    background = level + slope_y * (ys - 0.5) + slope_x * (xs - 0.5)
    image = background.clone()
    mask = torch.zeros(count, image_size, image_size, dtype=torch.bool)
    shapes = torch.randint(1, max_shapes + 1, (count,), generator=g)
    for k in range(max_shapes):
        cy, cx = uniform(0.15, 0.85, 1, 1), uniform(0.15, 0.85, 1, 1)
        radius, half_h, half_w = uniform(0.08, 0.22, 1, 1), uniform(0.06, 0.2, 1, 1), uniform(0.06, 0.2, 1, 1)
        disc = (ys - cy) ** 2 + (xs - cx) ** 2 <= radius**2
        rectangle = ((ys - cy).abs() <= half_h) & ((xs - cx).abs() <= half_w)
        is_disc = torch.rand(count, 1, 1, generator=g) < 0.5
        sign = torch.where(torch.rand(count, 1, 1, generator=g) < 0.5, -1.0, 1.0)
        contrast = sign * uniform(0.6, 1.2, 1, 1)
        shape = torch.where(is_disc, disc, rectangle) & (k < shapes).view(count, 1, 1)
        image = torch.where(shape, background + contrast, image)
        mask |= shape
    image = image + noise * torch.randn(image.shape, generator=g)
    return image.unsqueeze(1), mask.unsqueeze(1).float()


class ShapesDataModule(SplitLoaders):
    """Binary segmentation data from :func:`draw_shapes`: train, validation and test splits of ``(image, mask)``.

    Args:
        image_size: the side of the square images.
        train_size, val_size, test_size: images per split; each split is drawn from its own seed.
        max_shapes: shapes per image, 1 to this many.
        noise: the standard deviation of the pixel noise.
        batch_size: of every split.
        num_workers: DataLoader workers.
        seed: of the draw, so that every process (every pipeline stage) gets the same images.
    """

    in_channels = 1  # gray images; the CLI gives it to the model

    def __init__(
        self,
        image_size: int = 32,
        train_size: int = 1024,
        val_size: int = 256,
        test_size: int = 256,
        max_shapes: int = 3,
        noise: float = 0.3,
        batch_size: int = 32,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("train_size", train_size), ("val_size", val_size), ("test_size", test_size)):
            if value < 1:
                raise ValueError(f"`{name}` is a number of images, at least 1; got {value}.")
        self.image_size, self.max_shapes, self.noise, self.seed = image_size, max_shapes, noise, seed
        self.sizes = {"train": train_size, "val": val_size, "test": test_size}
        self.batch_size, self.num_workers = batch_size, num_workers
        self.splits = {}

    def setup(self, stage: Optional[str] = None) -> None:
        if self.splits:
            return
        for index, split in enumerate(SPLITS):  # seeds seed*3 + 0, 1, 2: no two splits or seeds share a draw
            images, masks = draw_shapes(
                self.sizes[split], self.image_size, self.max_shapes, self.noise, seed=self.seed * len(SPLITS) + index
            )
            self.splits[split] = TensorDataset(images, masks)
