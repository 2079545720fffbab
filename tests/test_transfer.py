"""Host <-> device copies through pinned memory (models/transfer.py): they equal a plain copy and,
on CUDA, return without waiting for work queued before them."""

import numpy as np
import pytest
import torch

from specextend.models.transfer import copy_from_host, record_event, to_device, to_host


@pytest.mark.parametrize("dtype", [torch.long, torch.bool, torch.float64])
def test_the_pinned_copy_helpers_equal_a_plain_copy(dtype):
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = [[3, 0, 7], [1, 1, 0]]
    want = torch.tensor(data, dtype=dtype, device=dev)
    for src in (data, np.array(data), torch.tensor(data)):
        got = to_device(src, dtype, dev)
        assert got.dtype == dtype and got.device.type == dev.type and torch.equal(got, want)
    arr = np.array(data)
    got = to_device(arr, dtype, dev)
    arr[0, 0] = 99  # a copy: the caller may reuse its data at once
    assert torch.equal(got, want)
    dst = torch.zeros(2, 3, dtype=dtype, device=dev)
    copy_from_host(dst, data)
    assert torch.equal(dst, want)
    back = to_host(want)
    event = record_event(dev)
    if event is not None:
        event.synchronize()
        assert back.is_pinned()
    assert back.device.type == "cpu" and torch.equal(back, want.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_pinned_copies_do_not_wait_for_queued_work():
    """A copy through pinned memory returns while a long kernel is still queued before it. (Whether a
    plain `torch.tensor(..., device=cuda)` from pageable memory waits depends on the driver's
    staging: on an H200 with torch 2.11, 2026-11-23, a 3-element one did not.)"""
    dev = torch.device("cuda")
    # the caching host allocator's first pinned block of a size is a cudaHostAlloc, which waits for
    # the device (the first run of this test on an H200 failed there): steady state reuses blocks
    to_device(list(range(64)), torch.long, dev)
    copy_from_host(torch.zeros(4, dtype=torch.long, device=dev), [1, 2, 3, 4])
    torch.cuda.synchronize()
    before = torch.cuda.Event()
    torch.cuda._sleep(int(2e9))  # ~1 s of device time
    before.record()
    x = to_device(list(range(64)), torch.long, dev)
    copy_from_host(torch.zeros(4, dtype=torch.long, device=dev), [1, 2, 3, 4])
    assert not before.query()  # the host went on while the device sleeps
    assert torch.equal(x.cpu(), torch.arange(64))  # (this one waits)
