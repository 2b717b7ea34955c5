"""A simplified U-Net as one flat ``nn.Sequential`` whose long skips are declared skip connections.

The model of torchgpipe's U-Net benchmarks (and of GPipe's skip-connection example): convolution
units of conv 3x3 (no bias), 2-D dropout, instance norm and leaky ReLU, stacked ``num_convs`` deep
at every level; ``depth`` encoder levels that each stash their output and halve the resolution; a
bottleneck; ``depth`` decoder levels that each double the resolution and concatenate the stash of
their encoder level; a 1x1 convolution to the output channels. Each level's stash and pop pair up in
a namespace of their own (:func:`~lightning_gpipe.engine.skip.isolate`), so every level can use the
same skip name.

The model is plain PyTorch: on one device the skips pass through a per-thread tracker, under a
pipeline each one goes straight from the stage of its stash to the stage of its pop.
"""

from __future__ import annotations

from torch import nn

from lightning_gpipe.engine.skip import Namespace, PopCat, Stash, isolate

__all__ = ["unet", "unet_layers"]

SKIP = "skip"  # every level's name; the namespaces keep the levels apart


def _unit(in_channels: int, out_channels: int, dropout: float) -> nn.Sequential:
    """One convolution unit: conv 3x3 (no bias: the norm that follows removes any offset), dropout, norm, ReLU."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
        nn.Dropout2d(dropout),
        nn.InstanceNorm2d(out_channels),
        nn.LeakyReLU(0.01),
    )


def _units(in_channels: int, hidden: int, out_channels: int, count: int, dropout: float) -> list[nn.Module]:
    """``count`` units from ``in_channels`` to ``out_channels`` through ``hidden`` channels in between."""
    widths = [in_channels] + [hidden] * (count - 1) + [out_channels]
    return [_unit(a, b, dropout) for a, b in zip(widths, widths[1:])]


def unet_layers(depth: int, num_convs: int) -> int:
    """``len(unet(depth, num_convs))``: each level's units and two more layers, the bottleneck's units, the last conv.

    >>> unet_layers(5, 5)
    76
    """
    return depth * (2 * num_convs + 4) + num_convs + 1


def unet(
    depth: int = 5,
    num_convs: int = 5,
    base_channels: int = 64,
    input_channels: int = 3,
    output_channels: int = 1,
    dropout: float = 0.1,
) -> nn.Sequential:
    """The simplified U-Net as a flat ``nn.Sequential``; its output is ``output_channels`` logits per pixel.

    Channels: encoder level ``i`` (0 the top) has ``C * 2**i`` (``C = base_channels``); the bottleneck
    widens to ``C * 2**depth`` inside and gives back ``C * 2**(depth-1)``; decoder level ``i`` takes the
    upsampled ``C * 2**i`` joined to its encoder's ``C * 2**i`` and gives ``C * 2**(i-1)`` (``C/2``, at
    least 1, at the top), which the final 1x1 convolution maps to ``output_channels``. torchgpipe's
    U-Net memory benchmark sizes it by ``(num_convs, base_channels)`` at depth 5: (6, 72) is 362.2M
    parameters, (11, 128) 2.21B, (24, 128) 4.99B, (24, 160) 7.80B, (48, 160) 15.82B (a test checks all five).

    Layers, in order (``len(model) == unet_layers(depth, num_convs)``, e.g. 76 at (5, 5), 37 at (3, 3)):
    for each encoder level, ``num_convs`` units, a :class:`~lightning_gpipe.Stash`, a ``MaxPool2d(2)``;
    the bottleneck's ``num_convs`` units; for each decoder level, an ``Upsample(scale_factor=2)``, a
    :class:`~lightning_gpipe.PopCat` and ``num_convs`` units; the final convolution. Every unit is one
    layer (a Sequential of conv, dropout, norm, ReLU), so a pipeline can cut between any two units.

    Any image of at least ``2**depth`` pixels a side works, odd sizes included: where pooling rounded a
    side down, :class:`~lightning_gpipe.PopCat` pads the upsampled input to its skip's size, and the
    output has the input's height and width. In training, the bottleneck's instance norm needs more
    than one pixel, so one side must be at least ``2**(depth+1)`` (16 for depth 3, 64 for depth 5).

    Args:
        depth: encoder (and decoder) levels, each halving (doubling) the resolution.
        num_convs: convolution units per level and in the bottleneck.
        base_channels: channels of the top encoder level.
        input_channels: image channels.
        output_channels: the logits per pixel (1 for a binary mask).
        dropout: of every unit's ``Dropout2d`` (torchgpipe's: 0.1).
    """
    for name, value in (
        ("depth", depth),
        ("num_convs", num_convs),
        ("base_channels", base_channels),
        ("input_channels", input_channels),
        ("output_channels", output_channels),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"unet: `{name}` must be a positive integer, got {value!r}.")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"unet: `dropout` is a probability in [0, 1), got {dropout!r}.")

    width = [base_channels * 2**i for i in range(depth + 1)]  # channels of encoder level i; width[depth]: bottleneck
    spaces = [Namespace() for _ in range(depth)]
    layers: list[nn.Module] = []
    channels = input_channels
    for level in range(depth):
        layers += _units(channels, width[level], width[level], num_convs, dropout)
        layers += [isolate(Stash(SKIP), spaces[level]), nn.MaxPool2d(2)]
        channels = width[level]
    layers += _units(channels, width[depth], width[depth - 1], num_convs, dropout)
    for level in reversed(range(depth)):
        out = max(width[level] // 2, 1)
        layers += [nn.Upsample(scale_factor=2), isolate(PopCat(SKIP), spaces[level])]
        layers += _units(2 * width[level], out, out, num_convs, dropout)
        channels = out
    layers.append(nn.Conv2d(channels, output_channels, kernel_size=1, bias=False))
    return nn.Sequential(*layers)
