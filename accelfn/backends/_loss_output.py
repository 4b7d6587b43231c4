"""What ``loss_fn`` returned: a scalar loss, ``(loss, metrics)`` or an ``af.Loss``, checked
and unpacked for the interpreter (``accelfn.backends._interpreter``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from accelfn.step import Loss

#: the metrics of a loss_fn that returned none (shared, never written)
NO_METRICS: Mapping[str, Any] = {}


def unpack(out: Any) -> tuple[torch.Tensor, Any, Mapping[str, Any], bool]:
    """``loss_fn``'s result as ``(loss, count or None, metrics, is_sum)``."""
    metrics: Mapping[str, Any] = NO_METRICS
    if type(out) is torch.Tensor and out.requires_grad and out.numel() == 1:  # the common case, fast
        return out, None, metrics, False
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], Mapping):
            what = f"of {len(out)} items" if len(out) != 2 else f"whose second item is a {type(out[1]).__name__}"
            raise TypeError(
                "loss_fn returned a tuple; it must be (loss, metrics) with metrics a mapping "
                f"of name to scalar (a dict), got a tuple {what}"
            )
        out, metrics = out
        check_metrics(metrics)
    if isinstance(out, Loss):
        total, count = out.total, out.count
        is_sum = True
    else:
        total, count, is_sum = out, None, False
    if not isinstance(total, torch.Tensor) or total.numel() != 1:
        what = f"a tensor of shape {tuple(total.shape)}" if isinstance(total, torch.Tensor) else type(total).__name__
        raise ValueError(
            f"loss_fn must return a scalar loss tensor (shape ()), got {what}; reduce it, "
            "e.g. loss.mean(), or return af.Loss(total=loss.sum(), count=n)"
        )
    if not total.requires_grad:
        raise ValueError(
            "loss_fn returned a loss that does not require grad: it is not computed from the "
            "model's trainable parameters (was it detached, or computed under torch.no_grad()?)"
        )
    return total, count, metrics, is_sum


#: metric names the step and ``run`` report themselves
RESERVED_METRICS = frozenset({"loss", "lr", "num_samples", "num_items", "grad_norm", "loss_scale", "skipped",
                              "samples_per_s", "updates_per_s", "items_per_s", "rss_mib", "peak_device_mib"})


def check_metrics(metrics: Mapping[str, Any]) -> None:
    """Raises for a reserved metric name, a non-scalar tensor or a value that is not a number."""
    for name, value in metrics.items():
        if name in RESERVED_METRICS or name.startswith("lr/"):  # lr/group{i}: each group's lr
            raise ValueError(
                f"loss_fn returned a metric named {name!r}, which accelfn reports itself; "
                f"rename it (reserved: {', '.join(sorted(RESERVED_METRICS))}, and names starting with 'lr/')"
            )
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"loss_fn's metric {name!r} is a tensor of shape {tuple(value.shape)}; metrics "
                    "must be scalars: reduce it, e.g. .mean()"
                )
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"loss_fn's metric {name!r} must be a number or a scalar tensor, got {value!r}")


def detach(value: Any) -> Any:
    """``value`` detached from the graph if it is a tensor (a metric), else as it is."""
    return value.detach() if isinstance(value, torch.Tensor) else value
