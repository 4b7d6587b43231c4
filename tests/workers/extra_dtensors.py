"""Worker for tests/checkpoint/test_extra_dtensors.py: DTensors in ``TrainState.extra`` (2 ranks).

Called in the session pool (``pool.call(..., function="extra_dtensors:check", out=DIR)``).
Under ``shard_params``, an EMA holding DTensor clones of the sharded parameters (what the
FSDP2 maintainers recommend, pytorch#144289), updated after every step, is checkpointed by
``Checkpoints(every_steps=4)`` and resumed with ``resume="auto"``; under ``replicate`` (model
not sharded) a DTensor in ``extra`` is refused. Each rank writes DIR/rank{r}.safetensors
(its EMA's local shards, the gathered EMA) and returns what it saw; the test compares.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import accelfn as af
from tests.helpers import programs as P
from tests.helpers import sharded as S


class EMA:
    """An EMA (decay 0.5) of the model's parameters as they are: DTensors under sharding."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.shadow, self.updates = model, [], 0

    def update(self) -> None:
        self.updates += 1
        with torch.no_grad():
            current = [p.detach().clone() for p in self.model.parameters()]
            if not self.shadow:
                self.shadow = current
            else:
                for s, c in zip(self.shadow, current):
                    s.mul_(0.5).add_(c, alpha=0.5)

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": self.shadow, "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shadow, self.updates = [t.clone() for t in state["shadow"]], state["updates"]


def make_state() -> af.TrainState:
    """SGD over ``Blocks`` with an empty EMA in ``extra`` (as a fresh run builds it)."""
    state = S.make_state("sgd")
    return state.replace(extra={"ema": EMA(state.model)})


def _local(ema: EMA) -> list[torch.Tensor]:
    return [t.to_local().clone() if hasattr(t, "to_local") else t.clone() for t in ema.shadow]


def check(out: str) -> dict[str, Any]:
    """Uninterrupted 8 updates (A); 4 updates with a checkpoint at step 4 (B), resumed with
    ``resume="auto"`` in a fresh state to the end (C); B's checkpoint loaded with ``af.load``
    into a fresh state sharded by ``backend.prepare`` (D); a DTensor in ``extra`` under
    ``replicate`` saved (E)."""
    backend = af.backends.auto()
    r, root = backend.rank, Path(out)
    program = af.shard_params()(af.train_step(P.mse))
    hooks = [af.Hook(lambda s, b: s.extra["ema"].update(), every_steps=1)]
    local = [(x[r::2], y[r::2]) for x, y in S.learnable(64)]
    whole = af.run(program, make_state(), local, backend=backend, progress=False, hooks=hooks)
    half = af.run(program, make_state(), local, backend=backend, progress=False, hooks=hooks, max_steps=4,
                  checkpoints=af.Checkpoints(root / "ckpt", every_steps=4))
    resumed = af.run(program, make_state(), local, backend=backend, progress=False, hooks=hooks,
                     checkpoints=af.Checkpoints(root / "ckpt", every_steps=4), resume="auto")
    fresh, _ = backend.prepare(program, make_state())  # sharded as run shards it, its EMA empty
    loaded = af.load(root / "ckpt" / "step_00000004", into=fresh, backend=backend)
    tensors: dict[str, torch.Tensor] = {}
    for name, state in (("whole", whole), ("half", half), ("resumed", resumed), ("loaded", loaded)):
        for i, t in enumerate(_local(state.extra["ema"])):
            tensors[f"{name}.local.{i}"] = t
        tensors.update(S.full_parameters(state.model, f"{name}.model."))
    for i, t in enumerate(half.extra["ema"].shadow):
        tensors[f"half.full.{i}"] = t.full_tensor()
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, root / f"rank{r}.safetensors")

    replicated = af.replicate()(af.train_step(P.mse))
    plain = af.run(replicated, P.make_state(), local[:1], backend=backend, progress=False)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (backend.world_size,))
    sharded_extra = EMA(plain.model)
    sharded_extra.shadow = [distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])]
    try:
        af.save(plain.replace(extra={"ema": sharded_extra}), root / "replicated", backend=backend)
        refused = None
    except af.CheckpointError as e:
        refused = str(e)
    return {
        "types": sorted({type(t).__name__ for s in (resumed, loaded) for t in s.extra["ema"].shadow}),
        "steps": [whole.step, half.step, resumed.step, loaded.step],
        "updates": [s.extra["ema"].updates for s in (whole, half, resumed, loaded)],
        "num": len(whole.extra["ema"].shadow),
        "refused": refused,
        "replicated_written": (root / "replicated").exists(),
    }
