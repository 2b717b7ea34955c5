"""How processes form pipelines and data-parallel replicas."""

import pytest

from lightning_gpipe.engine.topology import PipeLayout


def test_consecutive_ranks_form_a_pipeline_and_same_stages_form_replicas():
    layout = PipeLayout(world_size=6, pipe_size=3)
    assert layout.pipelines == [[0, 1, 2], [3, 4, 5]]
    assert layout.replicas(stage=2) == [2, 5]
    assert (layout.stage_of(4), layout.replica_of(4)) == (1, 1)
    assert layout.num_replicas == 2


def test_pipe_size_must_divide_the_world():
    with pytest.raises(ValueError, match="`pipe_size=4` does not divide the 6 processes"):
        PipeLayout(world_size=6, pipe_size=4)
