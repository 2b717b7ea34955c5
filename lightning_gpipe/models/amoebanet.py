"""AmoebaNet-D as one ``nn.Sequential`` of cells, which a pipeline can split between any two layers.

Every layer passes a Tensor or a ``(current, previous)`` pair of Tensors, so a stage boundary can fall
anywhere: the engine sends tuples of tensors between stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

import torch
from torch import Tensor, nn

from lightning_gpipe.models.operations import OPERATIONS, FactorizedReduce, ReLUConvBN

__all__ = ["Cell", "Classifier", "Genotype", "NORMAL", "REDUCTION", "Stem", "amoebanetd"]

States = Union[Tensor, tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class Genotype:
    """A cell's wiring. States 0 and 1 are the cell's two inputs (current, previous), both projected to
    the cell's width; each pair of ``operations`` ``(state, name)`` adds one state, the sum of the two
    operations' outputs. The cell returns the channel-wise concatenation of the states in ``concat``."""

    operations: tuple[tuple[int, str], ...]
    concat: tuple[int, ...]


#: AmoebaNet-D's normal cell as TensorFlow's reference implementation builds it. Its concatenation,
#: states (0, 3, 4, 6), differs from the AmoebaNet paper's figure; it is the one that gives the GPipe
#: paper's parameter counts.
NORMAL = Genotype(
    operations=(
        (1, "conv_1x1"),
        (1, "max_pool_3x3"),
        (1, "none"),
        (0, "conv_1x7_7x1"),
        (0, "conv_1x1"),
        (0, "conv_1x7_7x1"),
        (2, "max_pool_3x3"),
        (2, "none"),
        (1, "avg_pool_3x3"),
        (5, "conv_1x1"),
    ),
    concat=(0, 3, 4, 6),
)

#: AmoebaNet-D's reduction cell: the operations on the two inputs (states 0 and 1) have stride 2.
REDUCTION = Genotype(
    operations=(
        (0, "max_pool_2x2"),
        (0, "max_pool_3x3"),
        (2, "none"),
        (1, "conv_3x3"),
        (2, "conv_1x7_7x1"),
        (2, "max_pool_3x3"),
        (3, "none"),
        (1, "max_pool_2x2"),
        (2, "avg_pool_3x3"),
        (3, "conv_1x1"),
    ),
    concat=(4, 5, 6),
)


class Cell(nn.Module):
    """One normal or reduction cell: takes ``(current, previous)`` (or one Tensor), returns ``(output, current)``.

    Passing the current input on as the next cell's ``previous`` is what lets a chain of cells, each
    reading the two cells before it, be a plain Sequential.
    """

    def __init__(
        self,
        genotype: Genotype,
        previous_channels: int,
        current_channels: int,
        channels: int,
        reduction: bool,
        previous_reduced: bool,
    ) -> None:
        super().__init__()
        self.genotype, self.reduction = genotype, reduction
        self.current = ReLUConvBN(current_channels, channels)
        self.previous: nn.Module
        if previous_reduced:  # the previous input is at twice the current resolution
            self.previous = FactorizedReduce(previous_channels, channels)
        elif previous_channels != channels:
            self.previous = ReLUConvBN(previous_channels, channels)
        else:
            self.previous = nn.Identity()
        self.operations = nn.ModuleList(
            OPERATIONS[name](channels, 2 if reduction and state < 2 else 1) for state, name in genotype.operations
        )
        self.out_channels = channels * len(genotype.concat)

    def forward(self, states: States) -> tuple[Tensor, Tensor]:
        current, previous = (states, states) if isinstance(states, Tensor) else states
        if self.reduction and (current.shape[-1] % 2 or current.shape[-2] % 2):
            raise ValueError(
                f"A reduction cell got a {tuple(current.shape[-2:])} feature map; it halves the resolution and needs "
                "even sizes. Use images whose side is a multiple of 32 (the 'imagenet' stem) or of 4 "
                "(the 'small' stem)."
            )
        hidden = [self.current(current), self.previous(previous)]
        for i in range(0, len(self.operations), 2):
            (a, _), (b, _) = self.genotype.operations[i], self.genotype.operations[i + 1]
            hidden.append(self.operations[i](hidden[a]) + self.operations[i + 1](hidden[b]))
        return torch.cat([hidden[i] for i in self.genotype.concat], dim=1), current

    def extra_repr(self) -> str:
        return "reduction" if self.reduction else "normal"


class Stem(nn.Sequential):
    """The first convolution: 3x3, stride 2 for ImageNet-sized images, stride 1 for small ones; then BatchNorm."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__(
            nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False), nn.BatchNorm2d(out_channels)
        )


class Classifier(nn.Module):
    """ReLU, global average pooling, dropout and the linear layer that gives the logits."""

    def __init__(self, in_channels: int, num_classes: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, states: States) -> Tensor:
        x = states if isinstance(states, Tensor) else states[0]
        x = torch.relu(x).mean(dim=(2, 3))
        return self.fc(self.dropout(x))


def amoebanetd(
    num_classes: int = 1000,
    num_layers: int = 18,
    num_filters: int = 256,
    *,
    in_channels: int = 3,
    stem: Literal["imagenet", "small"] = "imagenet",
    dropout: float = 0.0,
) -> nn.Sequential:
    """AmoebaNet-D (L, D) as a flat ``nn.Sequential`` of stem, cells and classifier; its output is the logits.

    ``num_layers`` (L) normal cells, in three groups of L/3 separated by two reduction cells that halve
    the resolution and double the width; ``num_filters`` (D) is the width of the first group. The GPipe
    paper's sizes: (18, 208) is 81.5M parameters for 1000 classes, (18, 416) is 319.0M, (18, 544) 542.7M.
    A CPU size: ``amoebanetd(10, 9, 16, in_channels=1, stem="small")``, 246k parameters, trains on the 8x8
    digits in seconds per epoch (the main job, ``configs/amoebanet_digits.yaml``).

    Args:
        num_classes: the classifier's outputs.
        num_layers: normal cells in all, a multiple of 3.
        num_filters: channels of each operation in the first group of normal cells, a multiple of 8.
        in_channels: image channels.
        stem: ``"imagenet"``: a stride-2 convolution and two reduction cells, 32x down-sampling in all
            (image sides a multiple of 32, e.g. 224 or 480). ``"small"``: one stride-1 convolution,
            4x down-sampling (CIFAR's 32x32, the 8x8 digits).
        dropout: before the classifier's linear layer.

    Layers: the stem (one layer, or three with the two stem cells), then the cells, then the
    classifier; ``len(model) == L + 4`` with the "small" stem and ``L + 6`` with the "imagenet" one.
    Indices, not names, key the layers, so a pipeline's checkpoint loads into this Sequential.

    The cells are TensorFlow's reference AmoebaNet-D (which torchgpipe and the GPipe paper's counts follow):
    the normal cell concatenates states (0, 3, 4, 6) where the AmoebaNet paper's figure shows (4, 5, 6),
    and its wide convolutions are bottlenecks through a quarter of the channels.

    Deviations from those, none of which changes a parameter count (the test checks them against torchgpipe's):
    - ``max_pool_3x3`` is a max pool; torchgpipe's benchmark model uses an average pool there.
    - The classifier pools globally (TensorFlow's reference does too), so any multiple of 32 works;
      torchgpipe's ``AvgPool2d(7)`` fits 224 only. Like TensorFlow's, it applies a ReLU first.
    - The ImageNet stem convolution has padding 1 and no ReLU on the raw image (torchgpipe has one).
    - No auxiliary head and no drop-path: the GPipe paper's throughput and memory figures leave them
      out too, and the auxiliary head would need a second output at a cell in the middle.
    """
    if num_layers < 3 or num_layers % 3:
        raise ValueError(f"`num_layers` is the number of normal cells, a positive multiple of 3; got {num_layers}.")
    if num_filters < 8 or num_filters % 8:
        raise ValueError(
            f"`num_filters` must be a multiple of 8 (the ImageNet stem starts at num_filters/4 "
            f"channels, halved again by FactorizedReduce); got {num_filters}."
        )
    if stem not in ("imagenet", "small"):
        raise ValueError(f"`stem` must be 'imagenet' or 'small', got {stem!r}.")
    layers: list[nn.Module] = []
    channels = num_filters // 4 if stem == "imagenet" else num_filters
    layers.append(Stem(in_channels, channels, stride=2 if stem == "imagenet" else 1))
    previous = current = channels
    previous_reduced = False

    def add(genotype: Genotype, width: int) -> None:
        nonlocal previous, current, previous_reduced
        reduction = genotype is REDUCTION
        cell = Cell(genotype, previous, current, width, reduction, previous_reduced)
        layers.append(cell)
        previous, current, previous_reduced = current, cell.out_channels, reduction

    if stem == "imagenet":
        add(REDUCTION, num_filters // 2)
        add(REDUCTION, num_filters)
    for group in range(3):
        width = num_filters * 2**group
        if group:
            add(REDUCTION, width)
        for _ in range(num_layers // 3):
            add(NORMAL, width)
    layers.append(Classifier(current, num_classes, dropout))
    return nn.Sequential(*layers)
