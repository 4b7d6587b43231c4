"""``compile``: the forward and backward run through ``torch.compile``, the whole model's or
each repeated block's (regional compilation)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs

from accelfn.errors import boolean
from accelfn.step import Phase, TransformBase

#: the modes ``torch.compile(mode=...)`` accepts (None: its default)
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
OptionValue = str | int | float | bool


def _options(value: Mapping[str, OptionValue] | tuple[tuple[str, OptionValue], ...] | None,
             ) -> tuple[tuple[str, OptionValue], ...] | None:
    """A mapping of options as sorted ``(name, value)`` pairs, so the record stays hashable."""
    if value is None:
        return None
    items = value.items() if isinstance(value, Mapping) else value
    try:
        return tuple(sorted((name, option) for name, option in items))
    except (TypeError, ValueError):
        raise TypeError(f"compile(options=...) must be a mapping of option names to values, got {value!r}") from None


@attrs.frozen
class Compile(TransformBase):
    """The model's forward (and so its backward) runs through ``torch.compile``.

    The backend compiles the model it calls in the forward: after wrapping it in
    ``DistributedDataParallel`` for ``replicate()``, as PyTorch's DDP guidance asks
    (TorchDynamo's DDPOptimizer then splits the graph at DDP's bucket boundaries, so the
    gradient all-reduce still overlaps the backward). ``state.model`` stays the plain
    module, so checkpoints keep their names (no ``_orig_mod.`` prefix) and load into an
    uncompiled model. The first steps are slow: each new input shape compiles.

    With ``regions=True`` the backend compiles each of the model's repeated blocks in place
    instead (``nn.Module.compile``: the block's call goes through ``torch.compile``, its
    names unchanged), and the rest of the model runs eagerly: the blocks share one code
    object, so TorchDynamo compiles it once and every block reuses it (guarded on shapes,
    dtypes and whether the input requires a gradient, not on the block), which cuts the
    cold start by about the number of blocks. FSDP2's hooks stay outside each compiled block
    (TorchDynamo skips them), and a block whose activations are recomputed is compiled with
    its recomputation, as torchtitan composes them.

    Attributes:
        mode: ``torch.compile``'s mode: one of ``MODES``, or None for its default.
        fullgraph: fail on a graph break instead of falling back to Python.
        dynamic: compile for dynamic shapes (True), static ones (False), or decide (None).
        backend: the TorchDynamo backend name (``"inductor"``; ``"aot_eager"`` to debug).
        options: backend options (inductor's config, e.g. ``{"max_autotune": True}``) as
            sorted ``(name, value)`` pairs; not together with ``mode``.
        regions: compile each repeated block on its own (regional compilation) instead of
            the whole model.
    """

    phase: ClassVar[Phase] = Phase.MODEL
    kind: ClassVar[str] = "compile"
    verb: ClassVar[str] = "compile"

    mode: str | None = attrs.field(default=None)
    fullgraph: bool = attrs.field(default=False, validator=boolean)
    dynamic: bool | None = attrs.field(default=None, validator=attrs.validators.optional(boolean))
    backend: str = attrs.field(default="inductor")
    options: tuple[tuple[str, OptionValue], ...] | None = attrs.field(default=None, converter=_options)
    regions: bool = attrs.field(default=False, validator=boolean)

    @mode.validator
    def _check_mode(self, attribute: attrs.Attribute, value: str | None) -> None:
        if value is not None and value not in MODES:
            raise ValueError(f"compile(mode={value!r}): accepted values are None, {', '.join(map(repr, MODES))}")

    @backend.validator
    def _check_backend(self, attribute: attrs.Attribute, value: str) -> None:
        if not isinstance(value, str) or not value:
            raise TypeError(f"compile(backend=...) must be the name of a TorchDynamo backend such as 'inductor', "
                            f"got {value!r}")

    @options.validator
    def _check_options(self, attribute: attrs.Attribute, value: tuple[tuple[str, OptionValue], ...] | None) -> None:
        if value is None:
            return
        if self.mode is not None:
            raise ValueError(f"compile(mode={self.mode!r}, options=...): torch.compile takes a mode or options, "
                             "not both; pass one")
        for name, option in value:
            if not isinstance(name, str) or not isinstance(option, (str, int, float, bool)):
                raise TypeError(f"compile(options=...) maps option names to str/int/float/bool values, got "
                                f"{name!r}: {option!r}")

    def torch_compile_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``torch.compile`` this record stands for."""
        kwargs: dict[str, Any] = {"fullgraph": self.fullgraph, "dynamic": self.dynamic, "backend": self.backend}
        if self.mode is not None:
            kwargs["mode"] = self.mode
        if self.options is not None:
            kwargs["options"] = dict(self.options)
        return kwargs


def compile(  # noqa: A001 (the name of the transform, as torch.compile)
    *,
    mode: str | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    backend: str = "inductor",
    options: Mapping[str, OptionValue] | None = None,
    regions: bool = False,
) -> Compile:
    """Run the model's forward and backward through ``torch.compile``, with its options.

    Args:
        mode: ``"default"``, ``"reduce-overhead"`` (CUDA graphs), ``"max-autotune"``,
            ``"max-autotune-no-cudagraphs"``, or None for torch's default.
        fullgraph: raise on a graph break instead of running that part in Python.
        dynamic: True/False to force dynamic/static shapes, None to let torch decide.
        backend: a TorchDynamo backend name (``torch._dynamo.list_backends()``).
        options: backend options (inductor's ``torch._inductor.config`` names), not with ``mode``.
        regions: compile each of the model's repeated blocks (the children of every
            ``nn.ModuleList`` of two or more modules of one class, as ``shard_params`` picks its
            units) on its own, in place, instead of the whole model: one compilation serves
            every block, so the cold start is about one block's instead of the whole model's
            (Accelerate's ``compile_regions``, torchtitan's per-block ``torch.compile``). The
            parameters keep their names. Refused for a model without repeated blocks, and
            under ``pipeline()`` (its stages are traced graphs with no blocks left).

    Returns:
        Compile: the transform.

    Raises:
        ValueError: an unknown ``mode``, or ``mode`` and ``options`` together.
        TypeError: a flag that is not a bool, a ``backend`` that is not a name, ``options``
            that are not a mapping of names to str/int/float/bool.

    References:
        PyTorch, "torch.compile": https://pytorch.org/docs/stable/generated/torch.compile.html;
        "Reducing torch.compile cold start compilation time with regional compilation":
        https://pytorch.org/tutorials/recipes/regional_compilation.html;
        "DDP with torch.compile" (TorchDynamo DDPOptimizer):
        https://pytorch.org/docs/stable/notes/ddp.html#torchdynamo-ddpoptimizer

    Example:
        >>> import accelfn as af
        >>> af.compile(mode="max-autotune")
        Compile(mode='max-autotune', fullgraph=False, dynamic=None, backend='inductor', options=None, regions=False)
    """
    return Compile(mode, fullgraph, dynamic, backend, options, regions)
