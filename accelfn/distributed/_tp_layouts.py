"""What a tensor-parallel plan does to the layouts of weights and activations, checked.

A plan maps modules to torch ``ParallelStyle`` objects. Three mistakes of a plan train
silently or stop in torch's own words, far from the plan; each is refused here by name:

- **A style on a module it cannot split.** ``ColwiseParallel`` and ``RowwiseParallel`` split
  ``nn.Linear`` and ``nn.Embedding`` only (a wildcard that also matches a container, a
  transformers ``Conv1D``): refused before anything changes (:func:`check_modules`).
- **A tied weight split two ways.** A weight shared by two modules (an embedding tied to the
  output layer) is one tensor; ``parallelize_module`` replaces it per module, so under two
  styles (or one style and none) it would become two tensors, one of them left out of
  training (:func:`check_ties`). A plan that splits every name of it alike keeps one tensor
  (:func:`retie`); ``"auto"`` completes the model's own plan so (the embedding split by
  vocabulary rows, as its column-split output layer is); any other plan is refused.
- **A split activation where a whole one is meant.** A column-wise layer leaves each rank
  its part of the output's last dimension, which a row-wise layer (or a sequence-parallel
  one) must take next; a row-wise layer given a whole input, a column-wise one given a split
  input, or a loss computed from a split output all train on parts of the activations.
  :class:`LayoutWatch` follows the first forward of the split model (a
  ``TorchFunctionMode`` marking every tensor computed from a split output, module hooks
  reading the styles' layouts) and refuses, on every rank: a module whose input is not what
  its style takes (in the forward), and a model output that is split and has a gradient (in
  the backward of the first micro-batch, before any gradient reaches a parameter).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from accelfn.distributed.ops import is_dtensor

#: layouts an activation or weight can have, as the checks name them
SPLIT, WHOLE, DTENSOR = "split", "whole", "a DTensor"


def matches(pattern: str, name: str) -> bool:
    """``parallelize_module``'s rule: the parts of ``name`` match the ``.``-parts of ``pattern``."""
    parts, want = name.split("."), pattern.split(".")
    return len(parts) == len(want) and all(fnmatch.fnmatch(p, w) for p, w in zip(parts, want))


def spelled(value: Any) -> str:
    """How a plan spelled a style: its name (``'colwise'``) or the ParallelStyle's class."""
    return repr(value) if isinstance(value, str) else f"{type(value).__name__}(...)"


def _splits(style: Any) -> str | None:
    """``"colwise"`` or ``"rowwise"`` for torch's two layer-splitting styles, else None."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return "colwise" if isinstance(style, ColwiseParallel) else "rowwise" if isinstance(style, RowwiseParallel) else None


def _layout(placement: Any) -> str:
    from torch.distributed.tensor import Shard

    return SPLIT if isinstance(placement, Shard) else WHOLE


def input_layout(style: Any) -> str | None:
    """The layout a style takes its first input in when it is a plain tensor (None: not known)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    if _splits(style) is not None:
        return _layout(style.input_layouts[0])
    return SPLIT if isinstance(style, SequenceParallel) else None


def output_layout(style: Any) -> str | None:
    """The layout of a style's output (None: not known)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    if _splits(style) is not None:
        return _layout(style.output_layouts[0]) if style.use_local_output else DTENSOR
    if isinstance(style, SequenceParallel):
        return SPLIT if style.use_local_output else DTENSOR
    return None


# -- modules a style cannot split ---------------------------------------------------------


def check_modules(model: torch.nn.Module, plan: Mapping[str, Any], spelling: Mapping[str, str]) -> None:
    """Raises unless every module a layer-splitting style matches is an ``nn.Linear`` or ``nn.Embedding``.

    Args:
        model: the model the plan splits.
        plan: module pattern -> torch ParallelStyle.
        spelling: module pattern -> how the plan spelled its style (:func:`spelled`).

    Raises:
        ValueError: naming the pattern, its style, the modules it matched and their classes,
            and the layers inside them it may have meant (transformers' ``Conv1D``: why it cannot be split).
    """
    modules = [(n, m) for n, m in model.named_modules() if n]
    for pattern, style in plan.items():
        kind = _splits(style)
        if kind is None:
            continue
        wrong = [(n, m) for n, m in modules if matches(pattern, n) and not isinstance(m, (torch.nn.Linear,
                                                                                           torch.nn.Embedding))]
        if not wrong:
            continue
        listed = ", ".join(f"{n!r} ({type(m).__name__})" for n, m in wrong[:4]) + (
            f" and {len(wrong) - 4} more" if len(wrong) > 4 else "")
        why = (f"tensor_parallel(plan=...): {pattern!r} is {spelling[pattern]} and matches {listed}; torch's "
               f"{'ColwiseParallel' if kind == 'colwise' else 'RowwiseParallel'} splits nn.Linear and nn.Embedding "
               "layers only")
        if any(type(m).__module__.startswith("peft.") for _, m in wrong):
            raise ValueError(
                why + ". These are peft adapter layers (LoRA, ...): a base layer with the adapter's own small layers "
                "beside it, whose output it adds; accelfn has no tensor-parallel plan for them. Leave the adapted "
                "layers whole (out of the plan) and split layers without adapters, e.g. the MLP's: "
                "{'base_model.model.model.layers.*.mlp.gate_proj': 'colwise', ...up_proj: 'colwise', ...down_proj: "
                "'rowwise'}; or train with shard_params() alone")
        if any(type(m).__name__ == "Conv1D" for _, m in wrong):
            raise ValueError(
                why + ". transformers' Conv1D (GPT-2's layers) holds its weight transposed, (in, out), and GPT-2's "
                "attention projection c_attn computes q, k and v in one output that a split of its columns would mix "
                "across ranks: accelfn has no tensor-parallel plan for Conv1D models; train GPT-2 with "
                "shard_params() (FSDP2), or split a model built of nn.Linear layers (Llama-style)")
        inside = [c for c, sub in wrong[0][1].named_modules() if c and isinstance(sub, (torch.nn.Linear,
                                                                                         torch.nn.Embedding))]
        meant = ", ".join(repr(f"{pattern}.{c}") for c in inside[:4])
        raise ValueError(why + (f"; name the layers inside it, e.g. {meant}" if inside else
                                "; name nn.Linear or nn.Embedding modules (model.named_modules())"))


# -- tied weights ---------------------------------------------------------------------------


def _pattern_of(name: str, plan: Mapping[str, Any]) -> str | None:
    """The first pattern of ``plan`` that matches module ``name`` (None: the plan leaves it whole)."""
    return next((pattern for pattern in plan if matches(pattern, name)), None)


def _style_of(name: str, plan: Mapping[str, Any]) -> Any:
    pattern = _pattern_of(name, plan)
    return None if pattern is None else plan[pattern]


def _weight_layout(module: torch.nn.Module, attr: str, style: Any) -> tuple[str, ...] | None:
    """The placement a style gives ``module.attr`` (``("whole",)`` left as it is; None: not known)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    if style is None:
        return (WHOLE,)
    kind = _splits(style)
    if isinstance(style, SequenceParallel):
        return ("replicate",)
    if kind is None:
        return None
    embedding = isinstance(module, torch.nn.Embedding)
    if attr == "bias":
        return ("shard", "0") if kind == "colwise" else ("replicate",)
    dim = {("colwise", False): "0", ("rowwise", False): "1", ("colwise", True): "1", ("rowwise", True): "0"}
    return ("shard", dim[kind, embedding])


def _completion(module: torch.nn.Module, layout: tuple[str, ...]) -> tuple[str, Callable[[], Any]] | None:
    """The style that gives a whole ``module``'s weight ``layout`` with a whole output, or None."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(module, torch.nn.Embedding) and layout == ("shard", "0"):
        return "'embedding_rowwise'", lambda: RowwiseParallel(input_layouts=Replicate())
    if isinstance(module, torch.nn.Embedding) and layout == ("shard", "1"):
        return "ColwiseParallel(output_layouts=Replicate())", lambda: ColwiseParallel(output_layouts=Replicate())
    if isinstance(module, torch.nn.Linear) and layout == ("shard", "0"):
        return "'colwise_gather_output'", lambda: ColwiseParallel(output_layouts=Replicate())
    return None


def tied_names(model: torch.nn.Module) -> list[list[str]]:
    """The names of each parameter ``model`` holds under several names (tied), first owner first."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def check_ties(model: torch.nn.Module, plan: dict[str, Any], spelling: dict[str, str], *,
               complete: bool) -> dict[str, Any]:
    """``plan``, checked to split every name of a tied weight alike, and with ``complete``
    (``"auto"``) given the entries that make it so for names it leaves whole (added to
    ``spelling`` too).

    Raises:
        ValueError: a tied weight the plan splits two ways (or one way and not at all under
            another name), naming every name, its layout, and the fixes.
    """
    modules = dict(model.named_modules())
    plan = dict(plan)
    for group in tied_names(model):
        owners = [(n.rpartition(".")[0], n.rpartition(".")[2]) for n in group]
        layouts = [_weight_layout(modules[m], attr, _style_of(m, plan)) for m, attr in owners]
        split = [lay for lay in layouts if lay is not None and lay != (WHOLE,)]
        if None not in layouts and len(set(layouts)) == 1:
            continue
        if complete and split and len(set(split)) == 1 and None not in layouts:
            fills = {m: _completion(modules[m], split[0]) for (m, _), lay in zip(owners, layouts) if lay == (WHOLE,)}
            if all(fill is not None for fill in fills.values()):
                plan |= {m: fill[1]() for m, fill in fills.items() if fill is not None}
                spelling |= {m: fill[0] for m, fill in fills.items() if fill is not None}
                continue
        described = ", ".join(
            f"{n!r} ({'left whole' if lay == (WHOLE,) else spelling[_pattern_of(m, plan) or '']})"
            for n, (m, _), lay in zip(group, owners, layouts))
        raise ValueError(
            f"tensor_parallel(plan=...): {' and '.join(map(repr, group))} are one tied weight, and the plan splits it "
            f"two ways: {described}; parallelize_module would make two tensors of it and train one. Split it alike "
            "under every name (an nn.Embedding 'embedding_rowwise', RowwiseParallel(input_layouts=Replicate()), splits "
            "its vocabulary rows as a 'colwise' output layer does), leave every name of it out of the plan, or untie "
            "it (transformers: tie_word_embeddings=False)")
    return plan


def retie(model: torch.nn.Module, groups: list[list[str]]) -> None:
    """Points every name of each tied group at its first name's parameter after a split.

    Raises:
        ValueError: a group whose split parameters differ in layout (a plan function that split
            a tied weight two ways), naming them.
    """
    modules = dict(model.named_modules())
    for group in groups:
        params = [getattr(modules[n.rpartition(".")[0]], n.rpartition(".")[2]) for n in group]
        layouts = {(tuple(p.placements), p.device_mesh) if is_dtensor(p) else None for p in params}
        if len(layouts) != 1:
            raise ValueError(
                f"tensor_parallel(plan=...): the plan function split the tied weight {' = '.join(group)} two ways "
                "(each name got a tensor of its own, differently split); split it alike under every name, or untie it")
        for name, p in zip(group[1:], params[1:]):
            if p is not params[0]:
                owner, _, attr = name.rpartition(".")
                modules[owner].register_parameter(attr, params[0])


# -- outputs that are no views ---------------------------------------------------------------


def own_outputs(model: torch.nn.Module, plan: Mapping[str, Any]) -> None:
    """Makes the plain-tensor output of every planned module whose style hands one back
    (``use_local_output``) a tensor of its own rather than a view.

    torch's styles end with ``DTensor.to_local()``, which returns a view of the DTensor's
    local tensor (a fresh one, held by nothing else once the style's hook returns). Where
    such an output leaves a module that ``shard_params`` wraps (a model's output layer: the
    logits), FSDP2 warns that an in-place op on the view would drop its pre-backward hook and
    give wrong gradients. The output is replaced by ``aten._unsafe_view`` of itself: the same
    storage and shape, no copy, differentiable, and no view in autograd's eyes, so an in-place
    op on it is as safe as on any tensor and FSDP2 has nothing to warn of (its base, the
    discarded DTensor's local tensor, is read by nothing else).
    """
    for name, module in model.named_modules():
        style = _style_of(name, plan) if name else None
        if style is not None and output_layout(style) in (SPLIT, WHOLE):
            module.register_forward_hook(_own)


def _own(module: torch.nn.Module, args: Any, output: Any) -> Any:
    if isinstance(output, torch.Tensor) and not is_dtensor(output) and output._base is not None:
        return torch.ops.aten._unsafe_view(output, output.shape)
    return output


# -- the first forward ---------------------------------------------------------------------


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, Mapping):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


class _SplitValues(TorchFunctionMode):
    """Marks every plain tensor computed from a marked one (the split outputs' descendants)."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: dict[int, tuple[torch.Tensor, frozenset[str]]] = {}

    def of(self, t: torch.Tensor) -> frozenset[str]:
        """The split modules ``t`` was computed from (empty: a whole value)."""
        entry = self.sources.get(id(t))
        return entry[1] if entry is not None and entry[0] is t else frozenset()

    def mark(self, t: torch.Tensor, modules: frozenset[str]) -> None:
        if is_dtensor(t):
            return
        if modules:
            self.sources[id(t)] = (t, modules)
        else:
            self.sources.pop(id(t), None)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        modules = frozenset().union(*(self.of(t) for t in _tensors((args, kwargs or {}))))
        if modules:
            for t in _tensors(out):
                self.mark(t, modules)
            name = getattr(func, "__name__", "")
            if (name.endswith("_") or name == "__setitem__") and args and isinstance(args[0], torch.Tensor):
                self.mark(args[0], modules | self.of(args[0]))  # written in place
        return out


class LayoutWatch:
    """Follows the first forward with gradients of a model split by a plan and refuses a module
    given an input in a layout its style does not take, or a split model output that the loss
    uses (module docstring). Every hook is removed after that forward.

    Args:
        model: the split model (its modules carry torch's hooks already; these run around them).
        plan: module pattern -> torch ParallelStyle, as split.
        spelling: module pattern -> how the plan spelled its style (:func:`spelled`).
        size: the ranks of the tensor-parallel group (for the messages).
    """

    def __init__(self, model: torch.nn.Module, plan: Mapping[str, Any], spelling: Mapping[str, str], size: int):
        self._size = size
        self._said = {name: spelling[pattern] for name, _ in model.named_modules()
                      if name and (pattern := _pattern_of(name, plan)) is not None}
        self._values = _SplitValues()
        self._entered = False
        self._handles = [model.register_forward_pre_hook(self._enter, prepend=True),
                         model.register_forward_hook(self._leave, always_call=True)]
        for name, module in model.named_modules():
            style = _style_of(name, plan) if name else None
            if style is None or (input_layout(style) is None and output_layout(style) is None):
                continue
            self._handles += [
                module.register_forward_pre_hook(lambda m, args, n=name, s=style: self._takes(n, s, args),
                                                 prepend=True),
                module.register_forward_hook(lambda m, args, out, s=style, n=name: self._gives(n, s, out))]

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and not self._entered:
            self._entered = True
            self._values.__enter__()

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._entered:
            return
        self._values.__exit__(None, None, None)
        for t in _tensors(output):
            split = self._values.of(t)
            if split and t.requires_grad:
                t.register_hook(lambda grad, split=split: self._refuse_output(split))
        for handle in self._handles:
            handle.remove()
        self._values.sources.clear()

    def _takes(self, name: str, style: Any, args: Any) -> None:
        if not self._entered or not args or not isinstance(args[0], torch.Tensor) or is_dtensor(args[0]):
            return
        wants, split = input_layout(style), self._values.of(args[0])
        if wants == SPLIT and not split:
            raise ValueError(
                f"tensor_parallel(plan=...): {name!r} is {self._said[name]}, which takes its input split along the "
                f"{'last' if _splits(style) else 'sequence'} dimension over the {self._size} ranks (the output of a "
                "'colwise' layer before it), but its input is whole: each rank would read its whole input as its "
                "part. A 'rowwise' layer follows a 'colwise' one (Megatron's MLP: up 'colwise', down 'rowwise'); "
                "an nn.Embedding split by rows takes whole token ids: RowwiseParallel(input_layouts=Replicate())")
        if wants == WHOLE and split:
            raise ValueError(
                f"tensor_parallel(plan=...): {name!r} is {self._said[name]}, which takes its whole input, but its "
                f"input is split over the {self._size} ranks, computed from the output of {self._listed(split)}: "
                "each rank would "
                "read its part as the whole. Follow a 'colwise' layer with a 'rowwise' one, or gather its output "
                "(ColwiseParallel(output_layouts=Replicate()))")

    def _gives(self, name: str, style: Any, output: Any) -> None:
        if not self._entered:
            return
        layout = output_layout(style)
        if layout is None:  # a style whose output layout is not known: its input's marks carry on
            return
        for t in _tensors(output):
            self._values.mark(t, frozenset({name}) if layout == SPLIT else frozenset())

    def _refuse_output(self, split: frozenset[str]) -> None:
        raise ValueError(
            f"tensor_parallel(plan=...): the loss is computed from a model output that is split over the "
            f"{self._size} ranks of the tensor-parallel group: it comes from {self._listed(split)}, whose output each "
            "rank "
            "holds only its part of (the last dimension split), so each rank would train on its own part of the "
            "outputs. Gather it: give the output layer ColwiseParallel(output_layouts=Replicate()) ('auto' plans "
            "call it 'colwise_gather_output'), follow it with a 'rowwise' layer, or leave it out of the plan "
            "(refused before any gradient reached a parameter)")

    def _listed(self, modules: frozenset[str]) -> str:
        shown = [f"{m!r} ({self._said[m]})" for m in sorted(modules)]
        return ", ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")
