"""``prepare``'s two tables: the model phases in the order they apply, and the step functions
of the programs whose transform interprets them itself; and the ``Compile`` phase.

A parallelism is added as one transform, one module in ``distributed/`` holding its phase
(``of``, ``check``, ``apply``: ``distributed.phases.ModelPhase``), a row here and a plan rule;
``Backend.prepare`` itself names none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch

from accelfn.backends._deepspeed import DeepSpeedStepFn
from accelfn.backends._interpreter import StepFn, step_function
from accelfn.backends._invariant import InvariantStepFn
from accelfn.backends._pipeline_step import PipelineStepFn
from accelfn.backends._placement import Place
from accelfn.backends._tolerant_step import TolerantStepFn
from accelfn.distributed import (canonical, context_parallel, ddp, deepspeed, fault_tolerance, float8, fsdp, meta,
                                 pipeline, recompute, tensor_parallel)
from accelfn.distributed.phases import ModelPhase, Preparation
from accelfn.step import TransformBase
from accelfn.transforms import Compile as CompileSpec
from accelfn.transforms import Invariant, Pipeline, TolerateFaults
from accelfn.transforms.deepspeed import DeepSpeed
from accelfn.transforms.shard_params import repeated_blocks

if TYPE_CHECKING:
    from accelfn.backends.base import Backend


class Compile(ModelPhase):
    """``compile()``'s model phase, the last: the model the step calls (DDP's wrapper, if any)
    through ``torch.compile`` with the transform's options, as PyTorch's DDP guidance asks;
    ``state.model`` stays the plain module, so checkpoints keep their names.

    With ``regions=True``, each repeated block of ``state.model`` instead, in place
    (``nn.Module.compile``: its call compiled, its names and hooks unchanged), after sharding and
    recomputation, so FSDP2's hooks run outside each compiled block and a recomputed block is
    compiled with its recomputation (torchtitan's composition). A model whose blocks a previous
    ``prepare`` compiled has them uncompiled first.
    """

    name: ClassVar[str] = "compile"

    def __init__(self, spec: CompileSpec | None):
        self.spec = spec

    @classmethod
    def of(cls, prep: Preparation) -> Compile | None:
        spec = prep.step.find(CompileSpec)
        return None if spec is None and not _compiled_regions(prep.state.model) else cls(spec)

    def unsupported(self, prep: Preparation) -> str | None:
        """The backend's refusal of ``compile()`` (none for uncompiling the blocks of a model
        prepared before, without ``compile`` now)."""
        return None if self.spec is None else super().unsupported(prep)

    def check(self, prep: Preparation) -> None:
        """Raises ValueError for ``regions=True`` on a model without repeated blocks or under
        ``pipeline()`` (whose stages are traced graphs, without the blocks)."""
        if self.spec is None or not self.spec.regions:
            return
        if prep.step.find(Pipeline) is not None:
            raise ValueError("compile(regions=True) with pipeline(): each stage is a graph traced from the model, "
                             "with no blocks left to compile one by one; use compile() (each stage whole)")
        if not repeated_blocks(prep.state.model):
            raise ValueError(f"compile(regions=True): {type(prep.state.model).__name__} has no repeated blocks (an "
                             "nn.ModuleList of two or more modules of one class) to compile one by one; use "
                             "compile() to compile the whole model")

    def apply(self, prep: Preparation) -> None:
        for module in _compiled_regions(prep.state.model):
            module._compiled_call_impl = None  # noqa: SLF001  # nn.Module.compile's own attribute
            del module.__dict__[_REGION]
        if self.spec is None:
            return
        if not self.spec.regions:
            prep.model = torch.compile(prep.model, **self.spec.torch_compile_kwargs())  # type: ignore[assignment]
            return
        for _, block in repeated_blocks(prep.state.model):
            block.compile(**self.spec.torch_compile_kwargs())
            block.__dict__[_REGION] = True


#: the attribute of a block the ``Compile`` phase compiled (``compile(regions=True)``)
_REGION = "_accelfn_compiled_region"


def _compiled_regions(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of ``model`` a previous ``prepare`` compiled one by one."""
    return [m for m in model.modules() if m.__dict__.get(_REGION)]


#: the model phases, in the order ``prepare`` applies them (each checked before any applies):
#: an engine that runs the model itself; placement; the pipeline's cut; tensor parallelism;
#: context parallelism (the program's forward splits each sequence); fp8's conversion to
#: torchao's float8 layers (before activation checkpointing wraps blocks and FSDP2 shards them,
#: as torchtitan converts first); activation checkpointing (after TP and CP, before FSDP2:
#: torchtitan's order); sharding (FSDP2); a model built on the meta device filled (after the
#: splits, so that each rank allocates only its own shards, as torchtitan's ``to_empty`` after
#: parallelizing); fp8's float8 scales of sharded weights (kept current before each forward,
#: once the shards are real); replication (invariant's broadcast; tolerate_faults' link to the
#: other replica groups; or DDP); compilation (after DDP's wrapper).
PHASES: tuple[type[ModelPhase], ...] = (
    deepspeed.Engine,
    Place,
    pipeline.Cut,
    tensor_parallel.Split,
    context_parallel.Ring,
    float8.Convert,
    recompute.Recompute,
    fsdp.Shard,
    meta.Materialize,
    float8.Scales,
    canonical.Replicas,
    fault_tolerance.Replicas,
    ddp.DDP,
    Compile,
)

#: ``(transform, step function)``: a program holding the transform runs on that step function
#: (the first that matches); every other program on the interpreter's (``step_function``)
INTERPRETERS: tuple[tuple[type[TransformBase], Callable[[Backend, Preparation], StepFn]], ...] = (
    (DeepSpeed, DeepSpeedStepFn),
    (TolerateFaults, lambda backend, prep: TolerantStepFn(backend, prep.step, prep.state, prep.model, prep.link)),
    (Pipeline, PipelineStepFn),
    (Invariant, lambda backend, prep: InvariantStepFn(backend, prep.step, prep.state, prep.model)),
)


def interpreter(prep: Preparation) -> Callable[[Backend, Preparation], StepFn]:
    """The step function that runs ``prep``'s program (``INTERPRETERS``' first match)."""
    return next((make for kind, make in INTERPRETERS if prep.step.find(kind) is not None), step_function)


def acting(prep: Preparation) -> list[ModelPhase]:
    """The phases of ``PHASES`` that act on ``prep``'s program, in order."""
    return [phase for row in PHASES if (phase := row.of(prep)) is not None]


def unsupported(prep: Preparation, phases: list[ModelPhase]) -> list[tuple[str, str]]:
    """``(phase name, why)`` for each of ``phases`` the backend cannot run as the program asks."""
    return [(phase.name, reason) for phase in phases if (reason := phase.unsupported(prep)) is not None]
