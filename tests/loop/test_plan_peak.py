"""The plan's peak counter (``planning._peak.PeakTracker``) against hand-counted bytes: each
storage an operator creates counts from that operator until it is freed, views and storages
that existed before do not count, and a storage an ``out=`` operator grows counts its new size."""

from __future__ import annotations

import torch

from accelfn.loop.planning._peak import PeakTracker


def test_the_peak_is_the_largest_sum_of_live_new_storages():
    """x (known, 400 B) -> a = 2x (400 B), b = a[:50] (a view: 0 B), c = a + 1 (400 B): 800 B at
    once; a and c freed, then d = zeros(300) (1200 B) alone: the peak is 1200 B, and 0 B are live
    at the end once d is freed too."""
    x = torch.ones(100)
    with PeakTracker([x]) as tracker:
        a = x * 2
        b = a[:50]
        c = a + 1
        assert tracker.current == 800
        del a, b, c
        assert tracker.current == 0
        d = torch.zeros(300)
        assert tracker.current == 1200
        del d
    assert (tracker.peak, tracker.current) == (1200, 0)


def test_an_out_operator_that_grows_a_storage_counts_its_new_size():
    """An empty tensor (0 B) resized by ``torch.add(..., out=)`` to 100 floats counts 400 B."""
    x = torch.ones(100)
    with PeakTracker([x]) as tracker:
        out = torch.empty(0)
        torch.add(x, 1, out=out)
        assert tracker.current == 400
    assert tracker.peak == 400
