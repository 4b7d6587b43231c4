"""What ``backend.eval_batches`` accepts: a DataLoader it can shard by samples and pad."""

from __future__ import annotations

from typing import Any

from torch.utils.data import (
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)


def check_eval_loader(data: Any) -> None:
    """Raises unless ``data`` is a DataLoader that ``eval_batches`` can shard by samples.

    Raises:
        TypeError: ``data`` is not a DataLoader, or one over an IterableDataset (its padding
            could not be told apart), or with a sampler other than ``shuffle=False``/
            ``shuffle=True``'s (which ``eval_batches`` replaces).
        ValueError: a DataLoader without ``batch_size`` (a custom batch sampler), or with
            ``drop_last=True`` (evaluation reads every sample).
    """
    if not isinstance(data, DataLoader):
        raise TypeError(
            f"eval_batches() takes a torch.utils.data.DataLoader, got {type(data).__name__}; "
            "for any other iterable of batches use af.evaluate(fn, state, data, backend=...)"
        )
    if isinstance(data.dataset, IterableDataset):
        raise TypeError(
            "eval_batches() needs a DataLoader over a map-style dataset (with __len__ and "
            "__getitem__), so that gather_for_metrics can drop the padding; for an "
            "IterableDataset use af.evaluate(fn, state, loader, backend=...)"
        )
    if data.batch_size is None:
        raise ValueError(
            "eval_batches() needs a DataLoader built with batch_size=...; this one has "
            "batch_size=None (a custom batch_sampler, or unbatched samples)"
        )
    if data.drop_last:
        raise ValueError(
            "eval_batches() reads every sample once (the padding of the last batches is dropped by "
            "gather_for_metrics), so it cannot honour drop_last=True; build the evaluation DataLoader "
            "with drop_last=False"
        )
    if not isinstance(data.sampler, (SequentialSampler, RandomSampler)):
        raise TypeError(
            f"eval_batches() replaces the DataLoader's sampler, but this one uses "
            f"{type(data.sampler).__name__}; build the DataLoader with shuffle=False"
        )
