"""What ``checkpoint_activations`` does to a model: each chosen block's forward recomputed in
its backward, as the ``Recompute`` model phase (after tensor parallelism, before FSDP2).

A block is changed only in its ``forward``: an instance attribute (:class:`RecomputedForward`)
that runs the block's own forward through ``torch.utils.checkpoint.checkpoint`` (non-reentrant,
RNG state preserved). Nothing is wrapped around the block, so every parameter keeps its name
(torch's ``checkpoint_wrapper`` inserts ``_checkpoint_wrapped_module.`` into each): the state
dict, checkpoints, exports and the plan see the model's own names, and a checkpoint written
with recomputation loads without it and the reverse. FSDP2's hooks stay around the block
(``fully_shard`` of a block whose forward recomputes, as torchtitan shards its checkpoint-
wrapped blocks): its pre-backward gathers the parameters the recomputation reads. A deep copy
of the model (``af.plan``'s fake copy) recomputes the same blocks of the copy.

This is not parallelism, but it lives with the parallelisms' model phases, as torchtitan keeps
``activation_checkpoint.py`` beside its ``fsdp.py``: it is one of ``prepare``'s model phases, on
the same blocks as FSDP2's units, ordered among them, and the plan (``loop.planning``) applies it
to the model it traces from here.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from accelfn.distributed.phases import ModelPhase
from accelfn.transforms import CheckpointActivations

if TYPE_CHECKING:
    from accelfn.distributed.phases import Preparation


def _saved_ops() -> frozenset[Any]:
    """The operations whose outputs ``"ops"`` keeps: matrix products, attention, and the
    collectives of tensor parallelism (a recomputation would run them again); torchtitan's list."""
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_mm"]
    ops = [getattr(aten, n).default for n in names if hasattr(aten, n)]
    functional = getattr(torch.ops, "_c10d_functional", None)
    for name in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor"):
        op = getattr(functional, name, None) if functional is not None else None
        if op is not None:
            ops.append(op.default)
    return frozenset(ops)


SAVED_OPS = _saved_ops()


def _keep_products(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """``"ops"``'s per-operation rule: keep what ``SAVED_OPS`` computes, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class RecomputedForward:
    """The ``forward`` of a block whose activations are recomputed: the block's own forward
    through ``torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=True)``,
    with the per-operation policy of ``"ops"`` (``selective``) or none (``"full"``). Without
    gradients (evaluation, ``torch.no_grad``) the block's forward runs as it is: nothing is
    saved, so nothing is recomputed.

    Attributes:
        module: the block.
        selective: keep the outputs of ``SAVED_OPS`` (``"ops"``).
        own: the ``forward`` instance attribute the block had before (None: its class's).
    """

    def __init__(self, module: torch.nn.Module, *, selective: bool, own: Any = None):
        self.module = module
        self.selective = selective
        self.own = own

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.own if self.own is not None else type(self.module).forward.__get__(self.module)
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if self.selective:
            context = functools.partial(create_selective_checkpoint_contexts, _keep_products)
            return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context,
                              **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def recomputing(model: torch.nn.Module) -> list[tuple[str, RecomputedForward]]:
    """The blocks of ``model`` whose forward recomputes, by name, with their forwards."""
    return [(name, module.__dict__["forward"]) for name, module in model.named_modules()
            if isinstance(module.__dict__.get("forward"), RecomputedForward)]


def restore(model: torch.nn.Module) -> None:
    """Gives every block of ``model`` its own forward back (nothing recomputes)."""
    for _, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, RecomputedForward):
            if forward.own is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = forward.own


def recompute(model: torch.nn.Module, spec: CheckpointActivations | None) -> list[str]:
    """Makes the blocks ``spec`` chooses recompute (and no other), in place; returns their names.

    Args:
        model: the root module.
        spec: the transform, or None (nothing recomputes).

    Raises:
        ValueError: from ``spec.recomputed`` (a budget not resolved).
    """
    restore(model)
    if spec is None:
        return []
    chosen = spec.recomputed(model)
    for _, module in chosen:
        module.__dict__["forward"] = RecomputedForward(module, selective=spec.policy == "ops",
                                                       own=module.__dict__.get("forward"))
    return [name for name, _ in chosen]


def check_choice(model: torch.nn.Module, spec: CheckpointActivations) -> None:
    """Raises if ``spec`` chooses nothing in ``model``, or names blocks it does not have.

    Raises:
        ValueError: no candidate (named: the rule, the model's modules), a budget not resolved,
            or a budget's chosen names that are not candidates.
    """
    candidates = spec.candidates(model)
    if not candidates:
        if spec.modules is None:
            raise ValueError(
                f"checkpoint_activations(): {type(model).__name__} has no repeated blocks (an nn.ModuleList of two "
                "or more modules of one class) to recompute; name them: checkpoint_activations(modules=[...]) with "
                "module classes or name patterns")
        names = [n for n, _ in model.named_modules() if n][:8]
        raise ValueError(
            f"checkpoint_activations(modules={list(spec.modules)!r}) matches no module of {type(model).__name__} (its "
            f"modules include {', '.join(map(repr, names))}); name module classes, or patterns with '*' for one "
            "part of a name: 'blocks.*'")
    spec.recomputed(model)  # a budget not resolved
    if spec.chosen is not None:
        unknown = sorted(set(spec.chosen) - {n for n, _ in candidates})
        if unknown:
            raise ValueError(f"checkpoint_activations('budget') was resolved to blocks this model does not have "
                             f"({', '.join(unknown)}); plan it again for this model")


class Recompute(ModelPhase):
    """``checkpoint_activations()``'s model phase: the chosen blocks' forwards recompute, after
    tensor parallelism and before sharding (torchtitan's order). A model prepared before
    recomputes as this program says: other blocks, or none when the program has no
    ``checkpoint_activations``."""

    name: ClassVar[str] = "checkpoint_activations"

    def __init__(self, spec: CheckpointActivations | None):
        self.spec = spec

    @classmethod
    def of(cls, prep: Preparation) -> Recompute | None:
        spec = prep.step.find(CheckpointActivations)
        return cls(spec) if spec is not None or recomputing(prep.state.model) else None

    def check(self, prep: Preparation) -> None:
        """Raises ValueError for a choice of no block, or a budget not resolved (``af.run`` and
        ``af.plan`` resolve it)."""
        if self.spec is not None:
            check_choice(prep.state.model, self.spec)

    def apply(self, prep: Preparation) -> None:
        recompute(prep.state.model, self.spec)


def leaves(step_spec: CheckpointActivations | None, model: torch.nn.Module) -> frozenset[torch.nn.Module]:
    """The blocks ``pipeline``'s trace keeps whole (``call_module``), so that each stage calls
    the recomputing forward of its blocks: the blocks ``step_spec`` recomputes (none without it)."""
    if step_spec is None:
        return frozenset()
    return frozenset(module for _, module in step_spec.recomputed(model))
