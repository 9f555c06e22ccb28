"""The live-tensor tracker counts storages at the dispatcher, resizes included."""

import torch

from zeropp.memory_tracker import LiveTensorTracker


def test_counts_storages_once_follows_resizes_and_deaths():
    tracker = LiveTensorTracker()
    with tracker:
        a = torch.zeros(1000)  # 4000 bytes
        view = a.view(10, 100)  # the same storage: not counted again
        assert tracker.current_total() == 4000
        b = torch.empty(2000)
        assert tracker.current_total() == 12000
        del b
        assert tracker.current_total() == 4000
        a.untyped_storage().resize_(0)  # how the engine frees a gathered buffer
        assert tracker.current_total() == 0
        a.untyped_storage().resize_(8000)
        assert tracker.current_total() == 8000
        assert tracker.peak_total() == 12000
        del a, view
        assert tracker.current_total() == 0


def test_phases_keep_their_own_peaks_and_meta_tensors_cost_nothing():
    tracker = LiveTensorTracker()
    existing = torch.ones(250)
    tracker.track([existing, None])
    with tracker:
        tracker.mark_phase("first")
        temporary = torch.ones(500)
        del temporary
        tracker.mark_phase("second")
        kept = torch.ones(100)
        torch.empty(10**9, device="meta")
    assert tracker.phase_peak_total("first") == 1000 + 2000
    assert tracker.phase_peak_total("second") == 1000 + 400
    assert tracker.current_total() == 1400
    del kept


def test_backward_buffers_are_seen():
    tracker = LiveTensorTracker()
    weight = torch.randn(100, 100, requires_grad=True)
    tracker.track([weight])
    with tracker:
        (weight * weight).sum().backward()
    assert tracker.current_total() == 2 * 40000  # the weight and its gradient
    # In backward the weight, grad * weight from each factor, and their sum were alive together.
    assert tracker.peak_total() >= 3 * 40000
