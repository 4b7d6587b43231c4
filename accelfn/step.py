"""Step: the training program, a frozen record of the loss function and its transforms,
the composition machinery every transform shares (its phase, ``Step -> Step``
application, the composition checks), and what ``loss_fn`` may return (a loss, ``(loss,
metrics)`` or an ``af.Loss``), checked and unpacked for the interpreter."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, Union

import attrs
import torch

from accelfn.errors import TransformError, wrong_value

if TYPE_CHECKING:
    from accelfn.state import TrainState

T = TypeVar("T")


class Phase(enum.IntEnum):
    """Where in the step a transform acts; ``Step.transforms`` is sorted by it."""

    DATA = 0
    MODEL = 1
    FORWARD = 2
    BACKWARD = 3
    GRADIENT = 4
    UPDATE = 5


class TransformBase:
    """Shared behaviour: a transform applied to a Step returns a new Step that holds it."""

    phase: ClassVar[Phase]
    # Transforms of the same kind cannot be applied twice (clip and clip_value share one).
    kind: ClassVar[str]
    # The lowercase constructor users call, for error messages.
    verb: ClassVar[str]
    #: its step runs collectives over the ranks at every update, so every rank must run as many
    #: micro-batches (replicate, shard_params, tensor_parallel, pipeline, deepspeed)
    couples_ranks: ClassVar[bool] = False
    #: its step function reduces the gradients over data-parallel ranks itself: the model is not
    #: wrapped for replicate() (pipeline: one all-reduce per stage; invariant: the canonical sum)
    reduces_gradients: ClassVar[bool] = False
    #: an engine that places, partitions and wraps the model itself (deepspeed): prepare does not
    engine: ClassVar[bool] = False
    #: the program computes other values with it than without it; checkpoints record the transforms
    #: that do (False: checkpoint_activations, which changes what is kept, never a value)
    changes_results: ClassVar[bool] = True
    #: why its step computes the loss from the model's output instead of calling
    #: ``loss_fn(model, batch)`` (pipeline: on the last stage), so that the program's loss must be
    #: an ``af.output_loss(fn)``; None for a transform that calls ``loss_fn(model, batch)``
    loss_on_output: ClassVar[str | None] = None

    def __call__(self, step: Step) -> Step:
        if not isinstance(step, Step):
            raise TypeError(
                f"{self!r} transforms a Step, got {type(step).__name__}; "
                "build one with af.train_step(loss_fn)"
            )
        return step.with_transform(self)

    def init(self, state: TrainState) -> TrainState:
        """Adds this transform's entry to ``state.transforms_state``, keeping one already there."""
        return state

    def conflicts_with(self, other: TransformBase) -> str | None:
        """Why ``self`` and ``other`` cannot be composed, or None."""
        return None


def check_composition(existing: tuple[TransformBase, ...], new: TransformBase) -> None:
    """Raises TransformError if ``new`` repeats a kind in ``existing`` or conflicts with one."""
    for t in existing:
        if t.kind == new.kind:
            raise TransformError(
                f"{new!r} cannot be applied to a step that already has {t!r}: "
                f"one {new.kind} transform per step; remove one of them"
            )
        reason = t.conflicts_with(new) or new.conflicts_with(t)
        if reason:
            raise TransformError(f"{new!r} conflicts with {t!r}: {reason}")


@attrs.frozen(eq=False)
class Loss:
    """A summed loss and the number of items it sums, for exact weighting.

    Return ``Loss(total=per_token_loss.sum(), count=num_tokens)`` from ``loss_fn`` when
    micro-batches hold different numbers of items (tokens, say): the gradient of an update
    is then ``sum(total) / sum(count)`` over every micro-batch of the accumulation window
    and every rank, exactly as one big batch, instead of a mean of means.

    Attributes:
        total: scalar tensor, shape ``()``: the sum of the per-item losses.
        count: the number of items summed: an int or float >= 0, or a scalar tensor (not
            checked on the host, which would synchronize). A window whose counts sum to 0
            (over its micro-batches and ranks) has no items: its gradient is zero and its
            logged loss 0, whatever its totals.

    Raises:
        TypeError: ``total`` not a tensor, ``count`` not a number or tensor.
        ValueError: ``total`` or a tensor ``count`` of more than one element, ``count`` a
            negative number, or ``count`` the number 0 with a ``total`` that is not 0.
    """

    total: torch.Tensor = attrs.field()
    count: int | float | torch.Tensor = attrs.field()

    @total.validator
    def _check_total(self, attribute: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"Loss(total=...) must be a scalar tensor (shape ()), got {type(value).__name__}")
        if value.numel() != 1:
            raise ValueError(f"Loss(total=...) must be a scalar tensor (shape ()), got shape {tuple(value.shape)}: "
                             "pass the sum of the per-item losses (per_item_loss.sum())")

    @count.validator
    def _check_count(self, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
            raise TypeError(f"Loss(count=...) must be a number or a scalar tensor, got {type(value).__name__}")
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise ValueError(f"Loss(count=...) must be a number or a scalar tensor, got a tensor of shape "
                             f"{tuple(value.shape)}: pass the number of items summed (mask.sum())")
        if not isinstance(value, torch.Tensor) and not value >= 0:
            raise wrong_value("Loss", "count", ">= 0 (the number of items summed)", value)
        # a sum over no items is 0 (read from the device only in this rare case)
        if not isinstance(value, torch.Tensor) and value == 0 and bool(self.total.detach() != 0):
            raise ValueError(
                f"Loss(total={self.total.item():g}, count=0): a sum over no items is 0, so a total that is "
                "not 0 means the count or the total is wrong (count the items the total sums over, e.g. "
                "mask.sum(), and sum only those)"
            )


LossOutput = Union[torch.Tensor, Loss, "tuple[torch.Tensor | Loss, Mapping[str, Any]]"]


class LossFn(Protocol):
    """``loss_fn(model, batch)``: a scalar loss tensor, ``(loss, metrics)``, or ``af.Loss``."""

    def __call__(self, model: torch.nn.Module, batch: Any) -> LossOutput: ...


class OutputLossFn(Protocol):
    """``fn(output, targets)``: a scalar mean loss tensor, ``(loss, metrics)``, or ``af.Loss``."""

    def __call__(self, output: Any, targets: Any) -> LossOutput: ...


@attrs.frozen
class OutputLoss:
    """A loss computed from the model's output and the batch's targets, ``fn(output, targets)``,
    not from the model: the form of a program whose transform runs the model itself and hands
    the loss only its output (``pipeline``: the last stage's). Built by :func:`output_loss`.

    Attributes:
        fn: ``fn(output, targets)``, returning what any ``loss_fn`` may.
    """

    fn: OutputLossFn

    def __call__(self, output: Any, targets: Any) -> LossOutput:
        return self.fn(output, targets)


def output_loss(fn: OutputLossFn) -> OutputLoss:
    """Spells a loss as computed from the model's output: ``fn(output, targets)``.

    ``af.train_step(loss_fn)`` calls ``loss_fn(model, batch)``. Under ``pipeline()`` no rank
    holds the whole model: the last stage computes the loss from its output and the
    micro-batch's targets, so the program's loss is written ``af.train_step(af.output_loss(fn))``.
    The form is said, never guessed from parameter names: ``pipeline()`` refuses a plain
    ``loss_fn`` when it is applied, and ``prepare`` refuses an ``output_loss`` in a program
    without a transform that computes the loss from the output, each naming the fix.

    Args:
        fn: ``fn(output, targets)`` returning a scalar *mean* loss tensor over the micro-batch,
            ``(loss, metrics)``, or an ``af.Loss``; ``output`` is what the model's forward
            returns (batch first), ``targets`` the batch's second item.

    Returns:
        OutputLoss: ``fn``, marked (an ``OutputLoss`` given is returned as it is).

    Raises:
        TypeError: ``fn`` is not callable.

    Example:
        >>> import torch.nn.functional as F, accelfn as af
        >>> step = af.pipeline(["blocks.2"], size=2)(
        ...     af.train_step(af.output_loss(lambda output, targets: F.mse_loss(output, targets))))
        >>> type(step.loss_fn).__name__
        'OutputLoss'
    """
    if isinstance(fn, OutputLoss):
        return fn
    if not callable(fn):
        raise TypeError(f"output_loss(fn) needs a callable fn(output, targets), got {type(fn).__name__}")
    return OutputLoss(fn)


@attrs.frozen(eq=False)
class Step:
    """A training program: ``loss_fn`` and the transforms applied to it, in phase order.

    Build the base program with :func:`train_step` and apply transforms to it; applying a
    transform returns a new Step and never changes this one.

    Attributes:
        loss_fn: ``loss_fn(model, batch)`` returning a scalar loss tensor, ``(loss,
            metrics)`` with a mapping of scalar metrics, or an ``af.Loss``; under ``pipeline``
            an ``af.output_loss(fn)``, ``fn(output, targets)``.
        transforms: the transforms, sorted by the phase they act at.
    """

    loss_fn: LossFn | OutputLoss
    transforms: tuple[TransformBase, ...] = ()

    def with_transform(self, transform: TransformBase) -> Step:
        """Returns a new Step that also holds ``transform``.

        Raises:
            TransformError: a transform of the same kind is already there, or the two conflict.
        """
        check_composition(self.transforms, transform)
        # two of one phase (replicate and compile) are listed by kind, so the order stays canonical
        ordered = sorted((*self.transforms, transform), key=lambda t: (t.phase, t.kind))
        return attrs.evolve(self, transforms=tuple(ordered))

    def find(self, kind: type[T]) -> T | None:
        """The transform of type ``kind`` in this program, or None."""
        for t in self.transforms:
            if isinstance(t, kind):
                return t
        return None


def train_step(loss_fn: LossFn | OutputLoss) -> Step:
    """The base program: forward, backward, optimizer update, scheduler step, zero grad.

    Args:
        loss_fn: ``loss_fn(model, batch)`` returning a scalar loss tensor (shape ``()``),
            ``(loss, metrics)`` with ``metrics`` a mapping of name to scalar, or an
            :class:`af.Loss <Loss>`; under ``pipeline()``, :func:`output_loss` of a
            ``fn(output, targets)`` instead.

    Returns:
        Step: the program without transforms.

    Raises:
        TypeError: ``loss_fn`` is not callable.

    Example:
        >>> import torch.nn.functional as F, accelfn as af
        >>> step = af.train_step(lambda model, batch: F.mse_loss(model(batch[0]), batch[1]))
        >>> step.transforms
        ()
    """
    if not callable(loss_fn):
        raise TypeError(
            f"train_step(loss_fn) needs a callable loss_fn(model, batch), got {type(loss_fn).__name__}"
        )
    return Step(loss_fn)


def check_loss_form(step: Step) -> None:
    """Raises unless ``step``'s loss has the form its transforms call: ``af.output_loss(fn)``
    under a transform that computes the loss from the model's output (``loss_on_output``),
    ``loss_fn(model, batch)`` everywhere else.

    Raises:
        TransformError: naming the transform (or its absence) and the fix.
    """
    on_output = next((t for t in step.transforms if t.loss_on_output is not None), None)
    if on_output is not None and not isinstance(step.loss_fn, OutputLoss):
        raise TransformError(
            f"{on_output.verb}() {on_output.loss_on_output}, so it cannot call loss_fn(model, batch): spell the loss "
            "af.train_step(af.output_loss(fn)) with fn(output, targets) -> a scalar mean loss, e.g. "
            "af.output_loss(lambda output, targets: F.cross_entropy(output.flatten(0, 1), targets.flatten()))")
    if on_output is None and isinstance(step.loss_fn, OutputLoss):
        raise TransformError(
            "this step's loss is af.output_loss(fn), fn(output, targets): the form of a program whose transform "
            "computes the loss from the model's output (pipeline()); this program has none, so accelfn calls "
            "loss_fn(model, batch): pass that form to af.train_step (e.g. lambda model, batch: "
            "fn(model(batch[0]), batch[1])), or apply pipeline(...)")


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
