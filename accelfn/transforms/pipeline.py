"""``pipeline``: pipeline parallelism, the model cut into ``size`` stages run by a schedule.

``size`` is the mesh's ``pipe`` dimension, its outermost (``distributed.mesh``): rank ``r``
holds stage ``r // d`` and reads data shard ``r % d`` (``d = world_size // size``). The data-parallel replicas of one stage are consecutive ranks (on one node, where
their gradient all-reduce, the heavier collective, is cheapest); a pipeline's stages are
``d`` ranks apart, and send each other only activations (point to point), as torchtitan
lays pipelines out. The ranks of one pipeline read the same batch: the first stage its
inputs, the last its targets.

Each rank keeps only its stage's parameters, gradients and optimizer state; the stages run
``accumulate(n)``'s ``n`` micro-batches through ``torch.distributed.pipelining``'s schedule
(GPipe, 1F1B or interleaved 1F1B), and the loss is computed on the last stage, so the step's
loss function takes that stage's output, not the model (see :func:`pipeline`).

References:
    Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
    Parallelism", NeurIPS 2019. Narayanan et al., "PipeDream: Generalized Pipeline
    Parallelism for DNN Training", SOSP 2019 (1F1B); "Efficient Large-Scale Language Model
    Training on GPU Clusters Using Megatron-LM", SC 2021 (interleaved 1F1B).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from accelfn.errors import check_int, wrong_type
from accelfn.step import Phase, TransformBase, check_loss_form
from accelfn.transforms.compile import Compile
from accelfn.transforms.deepspeed import DeepSpeed
from accelfn.transforms.invariant import Invariant
from accelfn.transforms.replicate import Replicate
from accelfn.transforms.shard_params import ShardParams
from accelfn.transforms.tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from accelfn.step import Step

#: the schedules ``pipeline(schedule=...)`` names (torch.distributed.pipelining's
#: ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def _split_points(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise wrong_type("pipeline", "split_points", "a list of module names where a new stage begins, e.g. "
                         "['blocks.2'] (two stages) or ['blocks.1', 'blocks.2', 'blocks.3'] (four)", value)
    if not value:
        raise ValueError("pipeline(split_points=[]): name at least one module where a stage begins, e.g. "
                         "['blocks.2'] for two stages")
    if len(set(value)) != len(value):
        raise ValueError(f"pipeline(split_points={list(value)!r}): a module is named twice")
    return tuple(value)


def _size(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type("pipeline", "size", "an int >= 2 (the ranks one pipeline spans)", value)
    check_int("pipeline", "size", value, minimum=2)


def _schedule(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if value not in SCHEDULES:
        raise ValueError(f"pipeline(schedule={value!r}): use one of {', '.join(map(repr, SCHEDULES))}")


@attrs.frozen
class Pipeline(TransformBase):
    """Pipeline parallelism: the model cut at ``split_points`` into stages over ``size`` ranks.

    See :func:`pipeline`.

    Attributes:
        split_points: the module names where a stage begins, in the forward's order.
        size: the ranks one pipeline spans (one stage each, or several for interleaved 1F1B).
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``.
    """

    phase: ClassVar[Phase] = Phase.MODEL
    kind: ClassVar[str] = "pipeline"
    verb: ClassVar[str] = "pipeline"
    couples_ranks: ClassVar[bool] = True
    reduces_gradients: ClassVar[bool] = True
    loss_on_output: ClassVar[str | None] = (
        "computes the loss on the last stage, which holds only the end of the model, from that stage's output "
        "and the micro-batch's targets")

    split_points: tuple[str, ...] = attrs.field(converter=_split_points)
    size: int = attrs.field(validator=_size)
    schedule: str = attrs.field(default="1f1b", validator=_schedule)

    def __attrs_post_init__(self) -> None:
        stages = len(self.split_points) + 1
        per_rank = stages // self.size if stages % self.size == 0 else 0
        if self.schedule == "interleaved_1f1b" and per_rank < 2:
            raise ValueError(
                f"pipeline(schedule='interleaved_1f1b', size={self.size}) needs a multiple of {self.size} stages, "
                f"at least {2 * self.size} (each rank runs several), but {len(self.split_points)} split points make "
                f"{stages}; add split points, or use schedule='1f1b'")
        if self.schedule != "interleaved_1f1b" and stages != self.size:
            raise ValueError(
                f"pipeline(split_points={list(self.split_points)!r}, size={self.size}): {stages} stages on "
                f"{self.size} ranks; schedule={self.schedule!r} runs one stage per rank, so give {self.size - 1} "
                "split points (or schedule='interleaved_1f1b' for several stages per rank)")

    @property
    def num_stages(self) -> int:
        """The number of stages (split points + 1)."""
        return len(self.split_points) + 1

    def __call__(self, step: Step) -> Step:
        cut = super().__call__(step)
        check_loss_form(cut)  # the (output, targets) form, said with af.output_loss: refused now if not
        return cut

    def conflicts_with(self, other: TransformBase) -> str | None:
        refused = {
            TensorParallel: "pipeline() with tensor_parallel() (3-D PP x TP) is not built yet; use one of them",
            ShardParams: "pipeline() with shard_params() is not built yet; for data parallelism over the data "
                         "dimension compose replicate() (each stage's gradients averaged over its replicas)",
            Invariant: "pipeline() with invariant() is not built: the stages' schedule has no canonical sum tree",
            DeepSpeed: "pipeline() with deepspeed() is not supported: DeepSpeed has its own pipeline engine",
            Compile: "pipeline() with compile() is not built yet: compile each stage's modules in your model",
        }
        for kind, reason in refused.items():
            if isinstance(other, kind):
                return reason
        if isinstance(other, Replicate) and other.comm_hook is not None:
            return ("under pipeline(), replicate() averages each stage's gradients with one all-reduce of its own, "
                    "not through DDP: a comm_hook would not run; remove it")
        return None


def pipeline(split_points: str | list[str] | tuple[str, ...], *, size: int, schedule: str = "1f1b") -> Pipeline:
    """Pipeline parallelism (``torch.distributed.pipelining``): the model cut into stages.

    The model is traced (``torch.fx.symbolic_trace``) and cut before each split point (the
    first use of that module in the forward), so stage ``i`` runs the forward from split
    point ``i - 1`` to split point ``i``. Rank ``r`` keeps only stage ``r // d``'s parameters
    (``d = world_size // size``): the others are removed from its model and optimizer, so
    per rank the parameters, gradients and AdamW state are about ``1/size`` of the model's,
    and the activations of the micro-batches in flight (GPipe: all ``n``; 1F1B: at most
    ``size``). Parameter names stay the model's (``blocks.2.mlp.0.weight`` on the stage that
    holds it), so checkpoints and exports are the unsharded model's.

    The step's loss has another form under ``pipeline``, said with ``af.output_loss``:
    ``af.train_step(af.output_loss(fn))`` with ``fn(output, targets) -> loss``, a scalar
    *mean* loss over the micro-batch (a tensor), ``(loss, metrics)`` or an ``af.Loss``, where
    ``output`` is the last stage's output and ``targets`` the micro-batch's targets; every
    batch is a pair ``(inputs, targets)`` of tensors (or ``inputs`` a tuple of tensors, the
    model's positional arguments), batch first. A plain ``loss_fn`` (which accelfn calls as
    ``loss_fn(model, batch)`` everywhere else) is refused when ``pipeline`` is applied.
    ``accumulate(n)`` gives the schedule ``n`` micro-batches per update, and the update
    equals one of the window's batches joined (each micro-batch's loss weighted by its share
    of the window's samples); the logged ``loss`` is the window's mean, sent from the last
    stage to every rank. ``clip`` takes the exact norm over every stage's gradients.

    Composes with ``replicate()`` over the data dimension (each stage's gradients averaged
    over its ``d`` replicas, one all-reduce per update, not through DDP: its bucket options
    do not apply and a ``comm_hook`` is refused), ``shard_data()`` (sharded over the
    data dimension), ``with_precision`` (``"fp16"``: the loss scaled on the last stage, the
    inf check one verdict over every rank), ``accumulate``, ``clip``, ``clip_value``,
    ``skip_nonfinite`` (one verdict over every rank). Refused by name: ``tensor_parallel``,
    ``shard_params``, ``invariant``, ``deepspeed``, ``compile``.

    Requirements on the model: ``torch.fx.symbolic_trace`` can trace it (no control flow on
    tensor values); exactly one tensor crosses each split point (the hidden state); no
    parameter is used by two stages (untie an embedding shared with the output layer).

    Args:
        split_points: module names (as in ``model.named_modules()``) where a stage begins,
            in the forward's order: ``["blocks.2"]`` cuts a 4-block model into two stages.
            ``len(split_points) + 1`` stages: ``size`` of them (one per rank), or a multiple
            of ``size`` (at least ``2 * size``) for ``"interleaved_1f1b"``.
        size: the ranks one pipeline spans, >= 2; the world size must be a multiple.
        schedule: ``"gpipe"`` (all forwards, then all backwards), ``"1f1b"`` (one forward,
            one backward: at most ``size`` micro-batches' activations held) or
            ``"interleaved_1f1b"`` (several stages per rank, a smaller bubble).

    Returns:
        Pipeline: the transform.

    Raises:
        TypeError: ``split_points`` not a list of names; ``size`` not an int.
        ValueError: no split point, a repeated one, ``size`` < 2, an unknown schedule, a
            number of stages the schedule cannot place on ``size`` ranks.
        TransformError: applied to a step whose loss is not an ``af.output_loss(fn)`` (a
            plain ``loss_fn``, called ``loss_fn(model, batch)``), or composed with a refused
            transform.

    Example:
        >>> import accelfn as af
        >>> af.pipeline(["blocks.2"], size=2, schedule="gpipe").num_stages
        2
    """
    return Pipeline(split_points, size, schedule)  # the converter takes a str or list
