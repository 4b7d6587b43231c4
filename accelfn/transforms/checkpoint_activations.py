"""``checkpoint_activations``: chosen blocks keep only their inputs from the forward and run
their forward again in the backward (activation checkpointing, recomputation).

A block whose activations are recomputed frees, between its forward and its backward, every
tensor its forward saved for the backward but its inputs; its backward first runs its forward
again (``torch.utils.checkpoint``, non-reentrant, with the RNG state of the first forward, so
dropout draws the same masks) and then differentiates it. The results are those of the same
program without it, bit for bit; the cost is one more forward of each recomputed block per
micro-batch. The backend applies it to the model after tensor parallelism and before sharding
(torchtitan's order: FSDP2's units gather the parameters the recomputed forward reads).

References:
    Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016 (checkpointing every
    block of a chain). Korthikanti et al., "Reducing Activation Recomputation in Large
    Transformer Models", MLSys 2023 (selective recomputation: keep the matmul outputs,
    recompute the cheap pointwise operations).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Any, ClassVar, Literal, Union

import attrs
import torch

from accelfn.errors import check_int, wrong_type
from accelfn.step import Phase, TransformBase
from accelfn.transforms.deepspeed import DeepSpeed
from accelfn.transforms.shard_params import repeated_blocks

#: the policies ``checkpoint_activations(policy=...)`` accepts
POLICIES = ("full", "ops", "budget")
Policy = Literal["full", "ops", "budget"]
#: a module class (its instances are chosen) or a name pattern (``"blocks.*"``: fnmatch per name part)
ModuleChoice = Union[type[torch.nn.Module], str]


def _to_modules(value: object) -> tuple[ModuleChoice, ...] | None:
    """None, a module class, a name pattern, or an iterable of them -> a tuple (hashable)."""
    if value is None:
        return None
    items: Iterable[Any] = (value,) if isinstance(value, (str, type)) else value  # type: ignore[assignment]
    if not isinstance(items, Iterable):
        raise wrong_type("checkpoint_activations", "modules", "None, an nn.Module class, a module name pattern "
                         "(str, e.g. 'blocks.*'), or a list of them", value)
    chosen = tuple(items)
    for item in chosen:
        if isinstance(item, str):
            if not item:
                raise ValueError("checkpoint_activations(modules=...): an empty name pattern; name modules as "
                                 "model.named_modules() does, '*' for one part: 'blocks.*', 'layers.3'")
        elif not (isinstance(item, type) and issubclass(item, torch.nn.Module)):
            raise wrong_type("checkpoint_activations", "modules", "nn.Module classes or module name patterns (str)",
                             item)
    if not chosen:
        raise ValueError("checkpoint_activations(modules=[]): no module is chosen; leave modules=None for the "
                         "model's repeated blocks, or name module classes or name patterns")
    return chosen


def _every(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    check_int("checkpoint_activations", "every", value, minimum=1)


def _max_bytes(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if value is not None:
        check_int("checkpoint_activations", "max_bytes", value, minimum=1)


def _chosen(value: Iterable[str] | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(value)


def matches(pattern: str, name: str) -> bool:
    """Whether the module name ``name`` matches ``pattern``: as many ``.``-parts, each matching
    with ``fnmatch`` (``"blocks.*"`` matches ``"blocks.3"``, not ``"blocks.3.mlp"``), the rule of
    ``tensor_parallel``'s plans and torch's ``parallelize_module``."""
    parts, want = name.split("."), pattern.split(".")
    return len(parts) == len(want) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts, want))


@attrs.frozen
class CheckpointActivations(TransformBase):
    """Activation checkpointing of chosen blocks; see :func:`checkpoint_activations`.

    Attributes:
        policy: ``"full"``, ``"ops"`` or ``"budget"``.
        modules: the candidate blocks: None (the model's repeated blocks), or a tuple of module
            classes and name patterns.
        every: recompute every ``every``-th candidate (1: all of them).
        max_bytes: under ``"budget"``, the most bytes one micro-batch may add on a rank at its peak.
        chosen: under ``"budget"``, the names of the blocks the plan chose (None until then:
            ``af.run`` and ``af.plan`` choose them from a traced micro-batch).
    """

    phase: ClassVar[Phase] = Phase.MODEL
    kind: ClassVar[str] = "checkpoint_activations"
    verb: ClassVar[str] = "checkpoint_activations"
    #: the program computes the same values with it as without it, bit for bit: checkpoints do not record it
    changes_results: ClassVar[bool] = False

    policy: str = attrs.field(default="full")
    modules: tuple[ModuleChoice, ...] | None = attrs.field(default=None, converter=_to_modules)
    every: int = attrs.field(default=1, validator=_every)
    max_bytes: int | None = attrs.field(default=None, validator=_max_bytes)
    chosen: tuple[str, ...] | None = attrs.field(default=None, converter=_chosen, kw_only=True)

    @policy.validator
    def _check_policy(self, attribute: attrs.Attribute, value: object) -> None:
        if value not in POLICIES:
            raise ValueError(f"checkpoint_activations(policy={value!r}): accepted values are "
                             f"{', '.join(map(repr, POLICIES))}")

    def __attrs_post_init__(self) -> None:
        if self.policy == "budget" and self.max_bytes is None:
            raise ValueError("checkpoint_activations('budget') needs max_bytes=: the most bytes one micro-batch "
                             "may add on a rank at its peak (activations, temporaries and gradients)")
        if self.policy != "budget" and self.max_bytes is not None:
            raise ValueError(f"checkpoint_activations({self.policy!r}, max_bytes={self.max_bytes}): max_bytes is "
                             "the budget of policy='budget'; pass policy='budget' or leave max_bytes out")
        if self.policy == "budget" and self.every != 1:
            raise ValueError(f"checkpoint_activations('budget', every={self.every}): the budget chooses the blocks "
                             "itself; leave every out")
        if self.chosen is not None and self.policy != "budget":
            raise ValueError(f"checkpoint_activations({self.policy!r}, chosen=...): only a 'budget' is resolved "
                             "to chosen blocks; name blocks with modules=... instead")

    def candidates(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        """The blocks ``modules`` selects, in the model's module order, outermost only (a chosen
        module inside another chosen one is recomputed with it, not on its own).

        Args:
            model: the root module (its own name, ``""``, is never chosen).

        Returns:
            ``(qualified name, module)`` pairs.
        """
        if self.modules is None:
            return repeated_blocks(model)
        classes = tuple(m for m in self.modules if isinstance(m, type))
        patterns = [m for m in self.modules if isinstance(m, str)]
        found: list[tuple[str, torch.nn.Module]] = []
        for name, module in model.named_modules():
            if not name or any(name.startswith(outer + ".") for outer, _ in found):
                continue
            if (classes and isinstance(module, classes)) or any(matches(p, name) for p in patterns):
                found.append((name, module))
        return found

    def recomputed(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        """The blocks whose activations are recomputed: every ``every``-th candidate (the
        ``every``-th, the ``2 * every``-th, ..., as torchtitan's selective layer option), or,
        under ``"budget"``, the ones ``chosen`` names.

        Raises:
            ValueError: a ``"budget"`` not resolved yet (``chosen`` None).
        """
        candidates = self.candidates(model)
        if self.policy == "budget":
            if self.chosen is None:
                raise ValueError(
                    f"checkpoint_activations('budget', max_bytes={self.max_bytes}) chooses its blocks from a traced "
                    "micro-batch, which af.run does before it prepares the program; in a loop of your own, prepare "
                    "the program the plan resolved (af.plan(step, state, data).step), or name the blocks: "
                    "checkpoint_activations(modules=[...])")
            chosen = set(self.chosen)
            return [(n, m) for n, m in candidates if n in chosen]
        return candidates[self.every - 1::self.every]

    def resolved(self, chosen: Iterable[str]) -> CheckpointActivations:
        """This ``"budget"`` with its blocks chosen (the names of candidate blocks)."""
        return attrs.evolve(self, chosen=tuple(chosen))

    def conflicts_with(self, other: TransformBase) -> str | None:
        if isinstance(other, DeepSpeed):
            return ("a DeepSpeed engine runs the model itself, and DeepSpeed's activation checkpointing is called "
                    "from the model's own forward (deepspeed.checkpointing.checkpoint(block, x), configured by the "
                    "config's 'activation_checkpointing' section); accelfn does not wrap an engine's blocks. "
                    "Remove checkpoint_activations(), and checkpoint in the model's forward as DeepSpeed documents")
        return None


def checkpoint_activations(policy: Policy = "full", *, modules: ModuleChoice | Iterable[ModuleChoice] | None = None,
                           every: int = 1, max_bytes: int | None = None) -> CheckpointActivations:
    """Recompute the activations of chosen blocks in the backward instead of keeping them.

    Each recomputed block keeps only its inputs from the forward; its backward runs its
    forward again first (``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, the RNG
    state of the first forward restored, so dropout draws the same masks) and then
    differentiates it. Training gives the same parameters, bit for bit, as without it;
    evaluation (``af.evaluate``, any forward without gradients) runs each block once. The
    model is changed in place, but only its blocks' ``forward``: parameter names, the state
    dict, checkpoints and exports are the model's own, with or without it.

    Args:
        policy: ``"full"``: the chosen blocks keep nothing but their inputs. ``"ops"``:
            selective, per operation (torch's ``create_selective_checkpoint_contexts``): the
            outputs of matrix products and attention (``mm``, ``addmm``, ``bmm``, the
            scaled-dot-product attentions, and tensor parallelism's collectives) are kept,
            the pointwise operations between them (activations, norms, dropout) recomputed.
            ``"budget"``: recompute the fewest whole blocks such that one micro-batch's
            traced peak fits ``max_bytes`` (below).
        modules: the candidate blocks: None (default) for the model's repeated blocks (the
            children of every ``nn.ModuleList`` of two or more modules of one class,
            outermost lists first: a transformer's layers; the rule of ``shard_params``'s
            units), or a module class, a module name pattern (``"blocks.*"``, ``*`` for one
            part of a name, as ``model.named_modules()`` names them), or a list of them.
        every: recompute every ``every``-th candidate, in the model's order (the ``every``-th,
            ``2 * every``-th, ...: torchtitan's selective layer option); 1 recomputes all.
        max_bytes: for ``"budget"`` only: the most bytes one micro-batch's forward and
            backward may add on a rank at their peak (activations, temporaries and gradients:
            the plan's ``Memory.micro_batch``), in bytes.

    The budget's algorithm. One micro-batch (the data's first batch) is traced on fake tensors
    without recomputation (``af.plan``'s trace), measuring for each candidate block ``i`` (in
    forward order) ``s[i]``, the bytes of the tensors it creates and saves for its backward
    (what recomputing it frees, its inputs apart), and the timeline of the bytes held: each
    moment belongs to the prefix ``L`` of blocks whose saved tensors are held and not in use
    then (inside block ``j``'s forward or backward: ``L = j``; between blocks ``j`` and
    ``j + 1``, at the loss, and in the backward until block ``n - 1``'s starts: ``L = j + 1``,
    ``n``). Recomputing block ``i`` lowers every moment with ``L > i`` by ``s[i]``. With
    ``P[L]`` the peak of the moments of prefix ``L``, the fewest blocks are chosen greedily,
    which is optimal for such nested prefixes (an exchange argument: a block of a shorter
    prefix serves every longer one)::

        chosen = {}
        for L in increasing order:
            while P[L] - sum(s[i] for i in chosen if i < L) > max_bytes:
                add to chosen the block i < L not chosen with the largest s[i] (the earliest of equals)
                (none left: the budget cannot be met: ValueError)

    The micro-batch is then traced again with the chosen blocks recomputed; while its peak is
    over ``max_bytes`` (what the model above missed), the largest block not chosen is added.
    ``af.run`` chooses before it prepares the program (every rank alike: the same batch,
    traced the same way); ``af.plan`` reports the choice and the program it resolves
    (``plan.step``).

    Returns:
        CheckpointActivations: the transform.

    Raises:
        ValueError: an unknown ``policy``; ``"budget"`` without ``max_bytes``, or ``max_bytes``
            with another policy, or ``every`` with ``"budget"``; ``every`` or ``max_bytes``
            below 1; an empty pattern or list of modules. (A choice that matches no module, a
            budget no choice meets: when the program is prepared or planned.)
        TypeError: ``modules`` not classes or name patterns; ``every`` or ``max_bytes`` not an int.
        TransformError: composed with ``deepspeed(...)`` (DeepSpeed checkpoints from the
            model's own forward; see its message).

    References:
        Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016. Korthikanti et
        al., "Reducing Activation Recomputation in Large Transformer Models", MLSys 2023.
        PyTorch, "torch.utils.checkpoint": https://pytorch.org/docs/stable/checkpoint.html;
        torchtitan's ``distributed/activation_checkpoint.py`` (full, per-layer and per-op).

    Example:
        >>> import accelfn as af
        >>> af.checkpoint_activations("ops", every=2)
        CheckpointActivations(policy='ops', modules=None, every=2, max_bytes=None, chosen=None)
    """
    return CheckpointActivations(policy, modules, every, max_bytes)
