"""LiveBytes: the tensor bytes a block of code holds, on any device, for checking the planner's memory."""

from __future__ import annotations

import threading

import torch

from lightning_gpipe.balancing.plan import LiveBytes

KIB = 1024


def test_a_tensor_made_in_another_thread_counts_from_its_first_use_and_until_it_is_freed():
    box: list[torch.Tensor] = []
    with LiveBytes() as live:
        live.mark("start")
        thread = threading.Thread(target=lambda: box.append(torch.ones(256)))  # a receiving thread's message
        thread.start()
        thread.join()
        live.mark("received")
        total = box[0].sum()  # first use: counted from here
        live.mark("used")
        box.clear()  # freed
        live.mark("freed")
    assert live.held("received") == 0  # the mode sees only its own thread's operators
    assert live.held("used") == KIB + total.untyped_storage().nbytes()
    assert live.held("freed") == total.untyped_storage().nbytes()


def test_in_place_writes_and_views_count_no_new_bytes_and_left_out_tensors_are_not_counted():
    existing = torch.zeros(256)
    with LiveBytes([existing]) as live:
        live.mark("start")
        existing.add_(1)  # in place: the same storage
        view = existing[:128]  # a view: the same storage
        grad = torch.ones(512)  # 2 KiB, say a parameter's gradient kept in .grad
        live.mark("end")
    assert live.held("start") == KIB and live.held("end") == 3 * KIB
    assert live.peak("start", "end", leave_out=[grad]) == KIB
    assert view.untyped_storage().data_ptr() == existing.untyped_storage().data_ptr()


def test_a_sparse_gradient_counts_its_indices_and_values_and_can_be_left_out():
    # a sparse nn.Embedding's gradient: taking its storage raised, so profiling such a backbone (the default
    # balance, by time) failed with "Cannot access storage of SparseTensorImpl"
    embedding = torch.nn.Embedding(64, 16, sparse=True)
    with LiveBytes() as live:
        live.mark("start")
        embedding(torch.tensor([[1, 2, 3]])).sum().backward()
        live.mark("after")
    grad = embedding.weight.grad
    assert grad is not None and grad.is_sparse
    parts = grad._indices().untyped_storage().nbytes() + grad._values().untyped_storage().nbytes()
    assert live.held("after") >= parts
    assert live.held("after", leave_out=[grad]) == live.held("after") - parts
