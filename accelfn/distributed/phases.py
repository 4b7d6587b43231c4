"""The model phases of ``backend.prepare``: the protocol every parallelism's phase follows, and
the record the phases work on.

``prepare`` reads its table of phases (``backends._phases.PHASES``), asks each row whether it
acts on the program (``of``), checks every acting phase (``unsupported``, ``check``) before
any of them changes anything, then applies them in the table's order. A phase is what one parallelism (or placement, or
compilation) does to the model: it lives in that parallelism's own module
(``distributed.fsdp.Shard``, ``distributed.tensor_parallel.Split``, ...), so ``prepare``
names none of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import attrs
import torch

from accelfn.distributed.mesh import Mesh
from accelfn.state import TrainState
from accelfn.step import Step
from accelfn.transforms.precision import Policy

if TYPE_CHECKING:
    from accelfn.distributed.env import LaunchEnv
    from accelfn.transforms import Replicate

#: the attribute of a prepared model that holds its Prepared record
PREPARED_ATTRIBUTE = "_accelfn_prepared"


class Hardware(Protocol):
    """What the phases need of the backend that prepares: where this process stands, its
    device, and the backend's own way of replicating a model."""

    rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    place_model: bool
    env: LaunchEnv

    @property
    def name(self) -> str: ...

    @property
    def refusals(self) -> Mapping[str, str]: ...

    @property
    def collective_device(self) -> torch.device: ...

    def wrap_model(self, model: torch.nn.Module, replicate: Replicate) -> torch.nn.Module: ...

    def check_replicate(self, replicate: Replicate) -> None: ...


@attrs.define(eq=False)
class Preparation:
    """What ``prepare`` works on, changed in place by the phases as they apply.

    Attributes:
        hardware: the backend preparing (its rank, world, device, replication).
        step: the program.
        state: the state being prepared; its model and optimizer change in place.
        policy: the precision policy the program runs under.
        mesh: the program's mesh (``Mesh.of``).
        model: what the step's forward calls: the state's model, or its DDP wrapper, or a
            compiled one.
        forward_is_collective: every rank must run each forward together (set by the
            phases that split or shard the parameters the forward uses).
        engine: the engine a phase built that runs the model itself (DeepSpeed's), or None.
        stages: the ``(stage index, module)`` pairs this rank runs under ``pipeline``.
        link: this replica group's link to the others under ``tolerate_faults``
            (``distributed.fault_tolerance.Link``), or None.
    """

    hardware: Hardware
    step: Step
    state: TrainState
    policy: Policy
    mesh: Mesh
    model: torch.nn.Module
    forward_is_collective: bool = False
    engine: Any = None
    stages: list[tuple[int, torch.fx.GraphModule]] = attrs.Factory(list)
    link: Any = None


class ModelPhase:
    """One row of ``prepare``'s table: what a parallelism (or placement, or compilation) does to
    the program's model. Each phase subclasses this and lives in its parallelism's module.

    ``of`` is called for every row before anything changes; ``unsupported`` and ``check`` of
    every phase that acts run before the first ``apply``, so bad input is refused with the
    model untouched. ``af.plan`` asks ``of`` and ``unsupported`` too (they compute nothing
    across ranks).
    """

    #: the name docs, errors and plan problems use (the transform's verb, or ``"place"``, ``"materialize"``)
    name: ClassVar[str]

    @classmethod
    def of(cls, prep: Preparation) -> ModelPhase | None:
        """This phase for ``prep``'s program, or None when it does nothing to it."""
        raise NotImplementedError

    def unsupported(self, prep: Preparation) -> str | None:
        """Why the backend cannot run this phase as the program asks (its ``refusals``), or None.
        Pure: no collective, nothing changed."""
        return prep.hardware.refusals.get(self.name)

    def check(self, prep: Preparation) -> None:
        """Raises before anything changes if the phase cannot apply to ``prep`` (may run
        collectives: every rank checks alike)."""

    def apply(self, prep: Preparation) -> None:
        """Changes ``prep``'s model (and state, and the model the step calls) in place."""
        raise NotImplementedError


@attrs.frozen
class Prepared:
    """What ``prepare`` leaves on a model it prepared: the mesh of its program, and whether
    its forward is a collective (``af.evaluate`` reads it, to run the model outside a Step).

    Attributes:
        mesh: the program's mesh.
        forward_is_collective: every rank must run each forward together (FSDP2's all-gathers,
            tensor parallelism's all-reduces, a pipeline's stages, DeepSpeed's ZeRO-3 gathers).
    """

    mesh: Mesh
    forward_is_collective: bool


def layout(model: torch.nn.Module, rank: int, world_size: int) -> tuple[int, int, bool, bool]:
    """``(data rank, data world size, leads, forward is collective)`` of ``model`` at ``rank``,
    from the mesh of the program ``prepare`` last prepared it with: the ranks of one pipeline or
    tensor-parallel group read the same data and only the first of them (``leads``) reports;
    a model never prepared: ``(rank, world_size, True, False)``."""
    record = prepared(model)
    if record is None:
        return rank, world_size, True, False
    return (*record.mesh.data_coordinates(rank), record.mesh.leads(rank), world_size > 1 and record.forward_is_collective)


def prepared(model: torch.nn.Module) -> Prepared | None:
    """The record ``prepare`` left on ``model``, or None (a model never prepared)."""
    return getattr(model, PREPARED_ATTRIBUTE, None)


def remember(prep: Preparation) -> None:
    """Leaves ``prep``'s mesh and collective forward on its state's model (a plain attribute,
    not in its ``state_dict``)."""
    object.__setattr__(prep.state.model, PREPARED_ATTRIBUTE, Prepared(prep.mesh, prep.forward_is_collective))
