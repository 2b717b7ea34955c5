"""Skip connections: a layer stashes a tensor under a name, a later layer pops it, on any stage.

A U-Net's encoder outputs, a residual over several layers, an encoder's memory for its decoder: such
a tensor skips the layers in between. Declare it on the module class with :func:`skippable`, call
:func:`stash` and :func:`pop` inside ``forward``, and the model stays an ordinary ``nn.Sequential``
that runs on one device without this package's engine. Under :class:`~lightning_gpipe.GPipe` each
skip travels straight from the stage of its stash to the stage of its pop, and its gradient straight
back (:mod:`.layout` finds the routes and checks them when the pipeline is built; :mod:`.tracker`
holds the tensors of one micro-batch).

Example::

    @skippable(stash=["identity"])
    class Keep(nn.Module):
        def forward(self, x):
            stash("identity", x)
            return x

    @skippable(pop=["identity"])
    class AddBack(nn.Module):
        def forward(self, x):
            return x + pop("identity")

    model = nn.Sequential(Keep(), nn.Linear(8, 8), nn.ReLU(), AddBack())   # a residual over 2 layers
"""

from lightning_gpipe.engine.skip.declare import declared, isolate, pop, skippable, stash
from lightning_gpipe.engine.skip.keys import Namespace, SkipKey
from lightning_gpipe.engine.skip.layers import PopAdd, PopCat, Stash
from lightning_gpipe.engine.skip.layout import Route, SkipRoutes, find_skips
from lightning_gpipe.engine.skip.tracker import SkipTracker, use_tracker
from lightning_gpipe.engine.skip.traffic import StageSkips

__all__ = [
    "Namespace",
    "PopAdd",
    "PopCat",
    "Route",
    "SkipKey",
    "SkipRoutes",
    "SkipTracker",
    "StageSkips",
    "Stash",
    "declared",
    "find_skips",
    "isolate",
    "pop",
    "skippable",
    "stash",
    "use_tracker",
]
