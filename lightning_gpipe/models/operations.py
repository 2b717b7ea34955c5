"""The operations of AmoebaNet-D's cells: small modules, each mapping ``channels`` to ``channels``.

Every operation is built by ``OPERATIONS[name](channels, stride)``. Convolutions come as
ReLU-Conv-BatchNorm, as in the AmoebaNet and NASNet papers; the wide ones are bottlenecks through
``channels // 4`` (TensorFlow's AmoebaNet-D, which the GPipe paper's parameter counts are based on).
"""

from __future__ import annotations

from typing import Callable, Union

import torch
from torch import Tensor, nn

__all__ = ["OPERATIONS", "FactorizedReduce", "ReLUConvBN", "bottleneck"]


class ReLUConvBN(nn.Sequential):
    """ReLU, then a bias-free convolution, then BatchNorm: the unit every convolution of a cell is made of."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: Union[int, tuple[int, int]] = 1,
        stride: Union[int, tuple[int, int]] = 1,
        padding: Union[int, tuple[int, int]] = 0,
    ) -> None:
        super().__init__(
            nn.ReLU(),
            nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, bias=False),
            nn.BatchNorm2d(out_channels),
        )


class FactorizedReduce(nn.Module):
    """Halve the resolution without dropping pixels: two stride-2 1x1 convolutions, one shifted by a pixel.

    A single stride-2 1x1 convolution would only ever see the even pixels; the second path sees the
    odd ones. Their outputs are concatenated, so ``out_channels`` must be even. Inputs must have even
    height and width.
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        if out_channels % 2:
            raise ValueError(f"FactorizedReduce needs an even number of output channels, got {out_channels}.")
        self.relu = nn.ReLU()
        self.even = nn.Conv2d(in_channels, out_channels // 2, 1, stride=2, bias=False)
        self.odd = nn.Conv2d(in_channels, out_channels // 2, 1, stride=2, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(x)
        shifted = nn.functional.pad(x[:, :, 1:, 1:], (0, 1, 0, 1))
        return self.bn(torch.cat([self.even(x), self.odd(shifted)], dim=1))


def bottleneck(channels: int, *kernels: tuple[tuple[int, int], tuple[int, int]]) -> nn.Sequential:
    """``channels -> channels // 4``, the given ``(kernel, stride)`` convolutions, then back to ``channels``."""
    inner = channels // 4
    if inner < 1:
        raise ValueError(f"A bottleneck operation needs at least 4 channels, got {channels}.")
    layers = [ReLUConvBN(channels, inner)]
    for kernel, stride in kernels:
        padding = (kernel[0] // 2, kernel[1] // 2)
        layers.append(ReLUConvBN(inner, inner, kernel, stride, padding))
    layers.append(ReLUConvBN(inner, channels))
    return nn.Sequential(*layers)


def _none(channels: int, stride: int) -> nn.Module:
    # "none" is the identity; where the cell reduces, it must still halve the resolution.
    return nn.Identity() if stride == 1 else FactorizedReduce(channels, channels)


def _conv_1x1(channels: int, stride: int) -> nn.Module:
    return ReLUConvBN(channels, channels, 1, stride)


def _conv_3x3(channels: int, stride: int) -> nn.Module:
    return bottleneck(channels, ((3, 3), (stride, stride)))


def _conv_1x7_7x1(channels: int, stride: int) -> nn.Module:
    return bottleneck(channels, ((1, 7), (1, stride)), ((7, 1), (stride, 1)))


def _avg_pool_3x3(channels: int, stride: int) -> nn.Module:
    return nn.AvgPool2d(3, stride, padding=1, count_include_pad=False)


def _max_pool_3x3(channels: int, stride: int) -> nn.Module:
    return nn.MaxPool2d(3, stride, padding=1)


def _max_pool_2x2(channels: int, stride: int) -> nn.Module:
    if stride != 2:
        raise ValueError(
            "max_pool_2x2 only appears where a cell reduces (stride 2); with stride 1 it would shrink "
            "the feature map by a pixel."
        )
    return nn.MaxPool2d(2, stride)


#: name -> ``factory(channels, stride)``; the names are the AmoebaNet paper's.
OPERATIONS: dict[str, Callable[[int, int], nn.Module]] = {
    "none": _none,
    "conv_1x1": _conv_1x1,
    "conv_3x3": _conv_3x3,
    "conv_1x7_7x1": _conv_1x7_7x1,
    "avg_pool_3x3": _avg_pool_3x3,
    "max_pool_3x3": _max_pool_3x3,
    "max_pool_2x2": _max_pool_2x2,
}
