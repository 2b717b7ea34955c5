"""The GPU path on one CUDA device: pipeline-1 through the Trainer, re-materialization's memory, CUDA random streams.

These need a GPU and are skipped on the CPU machines that run CI. A pipeline of several GPUs over
NCCL needs as many GPUs (NCCL refuses two ranks on one device); ``test_two_gpus_...`` runs where
there are two.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import _models as M
import _sweeps
import lightning as L
import pytest
import torch
from torch import nn

from lightning_gpipe import GPipe, PipelineMonitor
from lightning_gpipe.launch import run_ok

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GPU = (("accelerator", "gpu"),)


def _deep(width: int = 1024, depth: int = 8, dropout: float = 0.0) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()] + ([nn.Dropout(dropout)] if dropout else [])
    return nn.Sequential(*layers)


@pytest.mark.parametrize("chunks, checkpoint", [(4, "always"), (3, "except_last")])
def test_pipeline_1_on_a_gpu_matches_lightnings_one_gpu_run(chunks, checkpoint):
    config = _sweeps.Config("gpu", strategy=(("chunks", chunks), ("checkpoint", checkpoint)), trainer=GPU)
    got, reference = _sweeps.run_config(config, devices=1), _sweeps.reference(config)
    # cuBLAS may pick other kernels for a micro-batch than for the whole batch (TF32 is off for matmuls):
    # measured on an H100, 0 in the losses and 3e-8 in the weights after 5 steps
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(reference["losses"]), atol=1e-6, rtol=0)
    for key, value in reference["weights"].items():
        torch.testing.assert_close(got["weights"][key], value, atol=1e-6, rtol=0)


def test_checkpoint_always_frees_activation_memory_on_the_gpu():
    device = torch.device("cuda")
    x = torch.randn(4096, 1024, device=device)
    peaks = {}
    for mode in ("never", "always"):
        torch.manual_seed(0)
        pipe = GPipe(_deep(), chunks=8, checkpoint=mode, device=device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        pipe(x).square().mean().backward()
        torch.cuda.synchronize()
        peaks[mode] = torch.cuda.max_memory_allocated() - start
        del pipe
    # never: every micro-batch keeps its graph until the drain, whose bulk is the output of each of the 8
    # Tanh layers (128 MiB over the batch); always: at most one micro-batch's graph (1/8 of it) at a time.
    # The rest (outputs, their gradients, parameter gradients) is the same in both modes. Measured on an
    # H100: 241 MiB (never), 96 MiB (except_last), 80 MiB (always).
    graph = 8 * x.numel() * 4
    assert peaks["never"] >= graph, peaks
    assert peaks["never"] - peaks["always"] >= 0.75 * graph, peaks


def test_recompute_on_the_gpu_replays_the_dropout_masks_of_the_first_forward():
    device = torch.device("cuda")
    x = torch.randn(64, 1024, device=device)
    results = {}
    for mode in ("never", "always"):
        torch.manual_seed(0)
        pipe = GPipe(_deep(depth=3, dropout=0.5), chunks=4, checkpoint=mode, device=device, seed=7)
        out = pipe(x)
        out.square().mean().backward()
        results[mode] = (out.detach(), [p.grad.clone() for p in pipe.parameters()])
    assert torch.equal(results["never"][0], results["always"][0])
    for a, b in zip(results["never"][1], results["always"][1]):
        assert torch.equal(a, b)  # the recomputed masks are the masks of the forward, bit for bit


def test_monitor_on_a_gpu_times_with_cuda_events_and_reports_cuda_memory(tmp_path):
    monitor = PipelineMonitor(dirpath=str(tmp_path))
    trainer = L.Trainer(
        strategy="gpipe", callbacks=[monitor], **M.trainer_kwargs(accelerator="gpu", devices=1, max_steps=4)
    )
    trainer.fit(M.Net(), M.loader())
    stage = monitor.summary[0]
    assert 0 < stage["utilization"] <= 1
    assert stage["forward"] > 0 and stage["backward"] > 0
    assert stage["peak_memory_mb"] > 0


def _two_gpu_fit(rank: int, world_size: int) -> dict:
    config = _sweeps.Config("two gpus", strategy=(("chunks", 4),), trainer=GPU)
    return _sweeps.run_config(config, devices=world_size)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a pipeline over NCCL needs two GPUs")
def test_two_gpus_over_nccl_match_one_gpu():
    got = run_ok(_two_gpu_fit, 2)[0]
    reference = _sweeps.reference(_sweeps.Config("two gpus", trainer=GPU))
    for key, value in reference["weights"].items():
        torch.testing.assert_close(got["weights"][key], value, atol=1e-6, rtol=0)


def test_the_fingerprint_on_a_gpu_tells_apart_one_ulp_an_order_a_shape_and_a_dtype_across_its_pieces():
    # the batch check and the initial-weights check on a GPU: sums computed there, in pieces of 2^22 elements
    from lightning_gpipe.engine.microbatch import fingerprint

    device = torch.device("cuda")
    big = torch.randn(2 * 2**22 + 5, device=device)  # three pieces, the last one short
    weights = [big, torch.tensor(2.0, device=device), torch.ones(3, dtype=torch.bfloat16, device=device)]
    assert fingerprint([w.clone() for w in weights]) == fingerprint(weights)
    nudged = big.clone()
    nudged[2**22 + 7] = torch.nextafter(nudged[2**22 + 7], torch.tensor(float("inf"), device=device))
    assert fingerprint([nudged, *weights[1:]]) != fingerprint(weights)
    swapped = big.clone()  # the same values, two of them moved between pieces: only the weighted sum sees it
    swapped[[3, 2 * 2**22 + 1]] = big[[2 * 2**22 + 1, 3]]
    assert fingerprint([swapped, *weights[1:]]) != fingerprint(weights)
    assert fingerprint([torch.ones(2, 3, device=device)]) != fingerprint([torch.ones(3, 2, device=device)])
    assert fingerprint([torch.ones(2, device=device)]) != fingerprint(
        [torch.ones(2, device=device, dtype=torch.float64)]
    )


def _with_synchronizations(call: Callable[[], Any]) -> tuple[Any, int]:
    """What ``call`` returns, and how many times it waited for the GPU (CUDA's synchronization debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with pytest.warns(UserWarning, match="synchroniz") as said:
            result = call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return result, len([w for w in said if "synchroniz" in str(w.message)])


def test_the_fingerprint_of_many_gpu_tensors_waits_for_the_gpu_once():
    # the per-step check of the layers outside the backbone: a stem of many BatchNorm buffers must not pay one
    # synchronization per tensor; the sums reach the host together
    from lightning_gpipe.engine.microbatch import fingerprint

    device = torch.device("cuda")
    buffers = [torch.randn(64, device=device) for _ in range(200)] + [torch.randn(2**22 + 3, device=device)]
    expected = fingerprint(buffers)  # also warms up the kernels
    got, waits = _with_synchronizations(lambda: fingerprint(buffers))
    assert got == expected and waits == 1
    changed = [b.clone() for b in buffers]
    changed[150][3] += 1
    assert fingerprint(changed) != expected
    swapped = [b.clone() for b in buffers]  # a small tensor's values moved: its bytes' CRC sees it
    swapped[7][[1, 2]] = buffers[7][[2, 1]]
    assert fingerprint(swapped) != expected


def test_the_fingerprints_of_a_stages_parameters_wait_for_the_gpu_once_and_equal_each_ones_fingerprint():
    # the check of backbone weights changed after the split reads every parameter of a stage at setup and at the
    # first step, one fingerprint each
    from lightning_gpipe.engine.microbatch import fingerprint, fingerprints

    device = torch.device("cuda")
    parameters = [torch.randn(64, device=device) for _ in range(100)] + [torch.randn(2**22 + 3, device=device)]
    expected = fingerprints(parameters)
    got, waits = _with_synchronizations(lambda: fingerprints(parameters))
    assert got == expected == [fingerprint(p) for p in parameters] and waits == 1


@pytest.mark.parametrize("mode", ["never", "always", "except_last"])
def test_an_in_place_first_layer_on_the_gpu_trains_as_the_plain_sequential(mode):
    # the first stage's leaves alias the batch's CUDA memory (engine/stage_input.py); the input needs grad, as
    # behind a stem, so the plain Sequential gets a non-leaf
    def net() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.LeakyReLU(0.1, inplace=True), nn.Linear(64, 64), nn.ReLU(inplace=True), nn.Linear(64, 8)
        )

    data = torch.randn(32, 64, device="cuda")
    plain, pipe = net().cuda(), GPipe(net(), chunks=4, checkpoint=mode, device=torch.device("cuda"))
    x_plain, x_pipe = data.clone().requires_grad_(), data.clone().requires_grad_()
    plain(x_plain * 1.0).square().sum().backward()
    pipe(x_pipe).square().sum().backward()
    for got, want in zip(pipe.parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x_pipe.grad, x_plain.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_saliency_map_on_the_gpu_equals_the_plain_sequentials_and_leaves_every_grad_alone(checkpoint):
    # engine/selective.py asks the autograd engine which nodes a backward will run; a CUDA graph has the same nodes
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Dropout(0.0), nn.Linear(64, 8)).cuda()
    pipe = GPipe(copy.deepcopy(plain), chunks=4, checkpoint=checkpoint, device=torch.device("cuda"))
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    (want,) = torch.autograd.grad(plain(x).square().sum(), x)
    (got,) = torch.autograd.grad(pipe(x).square().sum(), x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert all(p.grad is None for p in pipe.parameters()) and x.grad is None
    with pytest.raises(RuntimeError, match=r"backward with `create_graph=True` ran through the pipeline"):
        torch.autograd.grad(pipe(x).sum(), x, create_graph=True)
