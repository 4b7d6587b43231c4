"""replicate(comm_hook=...) on 2 ranks against hand-written DDP loops with the same hook
(tests/distributed/test_comm_hooks.py): uncompressed, fp16/bf16 compression and PowerSGD, with
PowerSGD's state resumed from a checkpoint; and the compression hooks' error measured."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

import accelfn as af

HOOKS = {"none": None, "fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook,
         "powersgd": powersgd.powerSGD_hook}
#: PowerSGD from the third synchronized backward on, rank 1 (the weights compress, the biases not)
POWERSGD = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 3}
STEPS = 8


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(STEPS)]


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _state() -> af.TrainState:
    model = _model()
    return af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.5))


def _by_hand(hook: Any, batches: list[Any]) -> list[torch.Tensor]:
    """The hand-written DDP loop with ``hook`` registered as torch's docs show."""
    model = _model()
    ddp = DistributedDataParallel(model)
    if hook is powersgd.powerSGD_hook:
        ddp.register_comm_hook(powersgd.PowerSGDState(process_group=None, **POWERSGD), hook)
    elif hook is not None:
        ddp.register_comm_hook(None, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for batch in batches:
        optimizer.zero_grad()
        _loss(ddp, batch).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _params(state: af.TrainState) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state.model.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _first_gradients(hook: Any, batch: Any) -> list[torch.Tensor]:
    """The averaged gradients of the first backward through DDP with ``hook``."""
    model = _model()
    ddp = DistributedDataParallel(model)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    _loss(ddp, batch).backward()
    return [p.grad.clone() for p in model.parameters()]


def _compression_error(hook: Any, unit_roundoff: float, floor: float, batch: Any) -> float:
    """The largest per-element error of ``hook``'s averaged gradient against the uncompressed
    one, over the documented bound ``3 u mean_r |g_r| + 3 floor`` (<= 1 when it holds)."""
    model = _model()
    _loss(model, batch).backward()
    local = [p.grad.clone() for p in model.parameters()]
    mean_abs = []
    for g in local:
        gathered = [torch.empty_like(g) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, g)
        mean_abs.append(torch.stack(gathered).abs().mean(0))
    exact, compressed = _first_gradients(None, batch), _first_gradients(hook, batch)
    return max(((c - e).abs() / (3 * unit_roundoff * m + 3 * floor)).max().item()
               for c, e, m in zip(compressed, exact, mean_abs, strict=True))


def check(out: str) -> dict[str, Any]:
    """Every claim of tests/distributed/test_comm_hooks.py on this rank."""
    backend = af.backends.auto()
    batches = _batches(backend.rank)
    result: dict[str, Any] = {}
    # torch's bf16 hook needs NCCL (CUDA): over gloo DDP refuses it when it is registered
    hooks = {k: v for k, v in HOOKS.items() if k != "bf16" or backend.name == "cuda"}
    for name, hook in hooks.items():
        comm_state = POWERSGD if name == "powersgd" else None
        step = af.replicate(comm_hook=hook, comm_state=comm_state)(af.train_step(_loss))
        state = af.run(step, _state(), batches, backend=backend, epochs=1, progress=False)
        result[f"{name}_equals_hand_ddp"] = _equal(_params(state), _by_hand(hook, batches))
        if name == "none":
            result["none_equals_hand_ddp_loop"] = result.pop("none_equals_hand_ddp")
            uncompressed = _params(state)
        else:
            result[f"{name}_differs_from_uncompressed"] = not _equal(_params(state), uncompressed)
        if name == "powersgd":
            memory = state.transforms_state["comm_hook"]
            result["powersgd_iter"] = memory.iter
            result["powersgd_compressed"] = sorted(memory.p)  # buckets with P matrices

            # a checkpoint at step 4 (PowerSGD compressing since iteration 3), resumed into a new state
            half = af.run(step, _state(), batches, backend=backend, epochs=1, max_steps=4, progress=False)
            af.save(half, f"{out}/half")
            resumed = af.load(f"{out}/half", into=_state())
            saved_iter = resumed.transforms_state["comm_hook"].iter
            resumed = af.run(step, resumed, batches, backend=backend, epochs=1, progress=False)
            result["powersgd_saved_iter"] = saved_iter
            result["powersgd_resumed_bitwise"] = _equal(_params(resumed), _params(state))
            # and a checkpoint's PowerSGD state matters: without it (a fresh hook state) the run differs
            fresh = af.load(f"{out}/half", into=_state())
            fresh = fresh.with_transform_state(comm_hook=None)
            fresh = af.run(step, fresh, batches, backend=backend, epochs=1, progress=False)
            result["powersgd_without_its_state_differs"] = not _equal(_params(fresh), _params(state))
    result["fp16_error_over_bound"] = _compression_error(HOOKS["fp16"], 2.0**-11, 2.0**-25, batches[0])
    if "bf16" in hooks:
        result["bf16_error_over_bound"] = _compression_error(HOOKS["bf16"], 2.0**-8, 0.0, batches[0])
    return result


def bf16_refused_over_gloo() -> str:
    """What replicate(comm_hook=bf16_compress_hook) raises when run prepares it over gloo."""
    backend = af.backends.auto()
    step = af.replicate(comm_hook=default_hooks.bf16_compress_hook)(af.train_step(_loss))
    try:
        af.run(step, _state(), _batches(backend.rank), backend=backend, epochs=1, progress=False)
    except NotImplementedError as e:
        return str(e)
    return "trained"
