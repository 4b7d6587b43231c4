"""The plan's activation checkpointing: each block's activation bytes, the micro-batch's peak
under each policy, and the blocks ``checkpoint_activations("budget")`` recomputes.

All of it is traced as the plan traces a micro-batch (``_memory.trace_micro_batch``: a fake copy
of the model, fake tensors, every storage counted from the operator that makes it until it is
freed), with the fake copy's blocks recomputing as a policy says
(``distributed.recompute.recompute``: the same forward ``prepare`` gives the real model).

One trace without recomputation also watches the blocks (:class:`BlockTracker`): for each
candidate block ``i`` (in the order the forward calls them), ``saved[i]``, the bytes of the
storages the block creates and saves for its backward, its outputs apart (what recomputing it
frees between its forward and its backward); and for each moment of the trace the prefix
``L`` of blocks whose saved storages are held and not in use then, with ``peaks[L]``, the most
bytes held at a moment of prefix ``L``. :func:`fewest_blocks` chooses from these;
``checkpoint_activations``' docstring states the algorithm.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch.utils._pytree import tree_flatten

from accelfn.distributed.recompute import recompute
from accelfn.loop.planning._memory import trace_micro_batch
from accelfn.loop.planning._peak import PeakTracker, _storage
from accelfn.step import Step
from accelfn.transforms import CheckpointActivations
from accelfn.transforms.precision import Policy

#: the policies whose micro-batch peak the plan reports, beside the program's own
COMPARED = ("none", "full", "ops")


@attrs.frozen
class Recomputation:
    """What the plan knows of activation checkpointing for the program's model.

    Attributes:
        blocks: ``(name, bytes)`` of each candidate block (``checkpoint_activations``'
            ``modules``; the model's repeated blocks by default), in the order the forward calls
            them: the bytes its forward creates and saves for the backward, its outputs apart
            (what recomputing it frees).
        peaks: the traced micro-batch peak in bytes under ``"none"`` (nothing recomputed),
            ``"full"``, ``"ops"`` (every candidate block) and the program's own policy (named
            as its record shows it, e.g. ``"full, every=2"``, ``"budget"``).
        chosen: the names of the blocks the program recomputes.
    """

    blocks: tuple[tuple[str, int], ...]
    peaks: Mapping[str, int]
    chosen: tuple[str, ...]


class BlockTracker(PeakTracker):
    """A ``PeakTracker`` that also watches ``blocks`` (modules of the traced fake model): what
    each one's forward saves for its backward, and the peak of each prefix of blocks (the
    module docstring). Entering it enters ``torch.autograd.graph.saved_tensors_hooks``.

    Attributes:
        names: the blocks' names, in the order the forward called them.
        saved: the bytes each of them saves (same order).
        peaks: prefix length -> the most bytes held at a moment of that prefix.
    """

    def __init__(self, known: list[torch.Tensor], blocks: Sequence[tuple[str, torch.nn.Module]]) -> None:
        super().__init__(known)
        self.names: list[str] = []
        self.saved: list[int] = []
        self.peaks: dict[int, int] = {}
        self._prefix = 0
        self._inside: int | None = None
        self._owner: dict[int, int] = {}  # id of a storage made inside a block -> that block's index
        self._counted: list[dict[int, int]] = []  # per block: id of a saved storage -> its bytes
        self._handles = []
        for name, block in blocks:
            self._handles.append(block.register_forward_pre_hook(self._enter_block(name)))
            self._handles.append(block.register_forward_hook(self._leave_block))
        self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> BlockTracker:
        super().__enter__()
        self._saving.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._saving.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        super().__exit__(*exc)

    def _enter_block(self, name: str) -> Callable[..., None]:
        def enter(module: torch.nn.Module, args: Any) -> None:
            if name not in self.names:
                self.names.append(name)
                self.saved.append(0)
                self._counted.append({})
            self._inside = self._prefix = self.names.index(name)
        return enter

    def _leave_block(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        index = self._inside
        assert index is not None
        for t in tree_flatten(output)[0]:  # its outputs live on as the next one's inputs: not freed by recomputing it
            st = _storage(t) if isinstance(t, torch.Tensor) else None
            if st is not None:
                self.saved[index] -= self._counted[index].pop(id(st), 0)
        self._inside, self._prefix = None, index + 1

    def _count(self, st: torch.UntypedStorage) -> None:
        new = id(st) not in self._seen
        super()._count(st)
        if new and self._inside is not None:
            self._owner[id(st)] = self._inside

    def _freed(self, key: int, counted: list[int], _ref: object) -> None:
        self._owner.pop(key, None)
        super()._freed(key, counted, _ref)

    def _pack(self, t: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        index = self._inside
        st = _storage(t)
        if index is not None and st is not None and self._owner.get(id(st)) == index \
                and id(st) not in self._counted[index]:
            self._counted[index][id(st)] = st.nbytes()
            self.saved[index] += st.nbytes()
        return t, index

    def _unpack(self, packed: tuple[torch.Tensor, int | None]) -> torch.Tensor:
        t, index = packed
        if index is not None:  # block index's backward is under way: its own activations are in use
            self._prefix = index
        return t

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.peaks[self._prefix] = max(self.peaks.get(self._prefix, 0), self.current)
        return out


def fewest_blocks(saved: Sequence[int], peaks: Mapping[int, int], max_bytes: int) -> list[int]:
    """The fewest blocks whose recomputation brings every prefix's peak within ``max_bytes``,
    by the model that recomputing block ``i`` lowers every moment of a prefix ``L > i`` by
    ``saved[i]`` (``checkpoint_activations``' docstring: greedy over the prefixes in increasing
    order, the largest block of the prefix first; optimal for nested prefixes). A prefix that
    no block can bring within the budget (its blocks all chosen) is left as it is: the trace of
    the choice decides.

    Args:
        saved: the bytes each block frees when recomputed, in forward order.
        peaks: prefix length -> the peak bytes of the moments of that prefix, nothing recomputed.
        max_bytes: the budget.

    Returns:
        The chosen blocks' indices, sorted.
    """
    chosen: set[int] = set()
    for length in sorted(peaks):
        over = peaks[length] - sum(saved[i] for i in chosen if i < length) - max_bytes
        while over > 0:
            free = [i for i in range(min(length, len(saved))) if i not in chosen and saved[i] > 0]
            if not free:
                break
            pick = max(free, key=lambda i: (saved[i], -i))
            chosen.add(pick)
            over -= saved[pick]
    return sorted(chosen)


#: ``(the blocks to recompute, or None for the program's own choice; policy) -> traced peak``
Tracer = Callable[..., int]


def adjusting(spec: CheckpointActivations | None) -> Callable[[torch.nn.Module], None]:
    """What makes a fake copy recompute as ``spec`` says (and run no compiled block of the real one)."""
    def adjust(fake: torch.nn.Module) -> None:
        for module in fake.modules():  # a compiled block's call is the real block's: run the fake one eagerly
            if getattr(module, "_compiled_call_impl", None) is not None:
                module._compiled_call_impl = None  # noqa: SLF001  # nn.Module.compile's own attribute
        recompute(fake, spec)
    return adjust


def label(spec: CheckpointActivations) -> str:
    """The name of ``spec``'s policy in ``Recomputation.peaks``: ``"full"``, ``"ops, every=2"``,
    ``"budget"``, ``"full, modules=..."``."""
    parts = [spec.policy]
    if spec.every != 1:
        parts.append(f"every={spec.every}")
    if spec.modules is not None:
        parts.append("modules=" + ", ".join(m if isinstance(m, str) else m.__name__ for m in spec.modules))
    return ", ".join(parts)


def plan_recomputation(spec: CheckpointActivations, model: torch.nn.Module, batch: Any,
                       loss_of: Callable[[torch.nn.Module, Any], torch.Tensor], autocast: Callable[[], Any],
                       policy: Policy, device: torch.device | None) -> tuple[Recomputation, CheckpointActivations, str]:
    """The plan's activation checkpointing for ``spec`` (a ``"budget"`` resolved), the
    resolved record, and a problem's text when the budget cannot be met (else ``""``).

    Raises:
        ValueError: ``spec`` chooses no block of ``model`` (from ``spec.candidates``).
    """
    candidates = spec.candidates(model)
    if not candidates:
        raise ValueError("checkpoint_activations() chooses no block of the model")

    def trace(with_spec: CheckpointActivations | None, tracker: Any = None) -> int:
        return trace_micro_batch(model, batch, loss_of, autocast, policy, device=device,
                                 adjust=adjusting(with_spec), tracker=tracker)

    watched: list[BlockTracker] = []

    def watching(known: list[torch.Tensor], fake: torch.nn.Module) -> BlockTracker:
        watched.append(BlockTracker(known, spec.candidates(fake)))
        return watched[-1]

    peaks = {"none": trace(None, watching)}
    watcher = watched[0]
    full = CheckpointActivations("full", spec.modules)
    peaks["full"] = trace(full)
    peaks["ops"] = trace(CheckpointActivations("ops", spec.modules))
    problem = ""
    if spec.policy == "budget":
        assert spec.max_bytes is not None
        spec, problem = _budget(spec, watcher, peaks, trace)
    if spec.policy != "budget" and spec not in (full, CheckpointActivations("ops", spec.modules)):
        peaks[label(spec)] = trace(spec)
    chosen = tuple(n for n, _ in spec.recomputed(model)) if not problem else ()
    blocks = tuple(zip(watcher.names, watcher.saved))
    return Recomputation(blocks=blocks, peaks=peaks, chosen=chosen), spec, problem


def _budget(spec: CheckpointActivations, watcher: BlockTracker, peaks: dict[str, int],
            trace: Callable[[CheckpointActivations | None], int]) -> tuple[CheckpointActivations, str]:
    """The budget resolved (``checkpoint_activations``' algorithm), and a problem's text or ``""``.

    The choice of :func:`fewest_blocks` is traced; while its peak is over the budget (what the
    model missed), each block not chosen is tried in turn (largest first) as one more, and the
    first that fits is taken; when none does, the largest is added and the search goes on.
    Recomputing every candidate (the ``"full"`` trace) bounds it: a budget that does not fit
    even then is a problem, said at once.
    """
    max_bytes = spec.max_bytes
    assert max_bytes is not None
    names, saved = watcher.names, watcher.saved
    if peaks["none"] <= max_bytes:
        peaks["budget"] = peaks["none"]
        return spec.resolved(()), ""
    if peaks["full"] > max_bytes:
        peaks["budget"] = peaks["full"]
        return spec, (f"checkpoint_activations('budget', max_bytes={max_bytes}): even with all {len(names)} blocks "
                      f"recomputed, one micro-batch adds {peaks['full']} bytes at its peak (nothing recomputed: "
                      f"{peaks['none']})")
    chosen = [names[i] for i in fewest_blocks(saved, watcher.peaks, max_bytes)]

    def fits(blocks: list[str]) -> CheckpointActivations | None:
        resolved = spec.resolved(sorted(blocks, key=names.index))
        peak = trace(resolved)
        if peak > max_bytes:
            return None
        peaks["budget"] = peak
        return resolved

    found = fits(chosen)
    while found is None:
        rest = sorted((i for i, n in enumerate(names) if n not in chosen), key=lambda i: (-saved[i], i))
        found = next((r for r in (fits([*chosen, names[i]]) for i in rest) if r is not None), None)
        chosen.append(names[rest[0]])
    return found, ""


def resolved_step(step: Step, spec: CheckpointActivations, resolved: CheckpointActivations) -> Step:
    """``step`` with its ``checkpoint_activations`` record ``spec`` replaced by ``resolved``."""
    return attrs.evolve(step, transforms=tuple(resolved if t is spec else t for t in step.transforms))
