"""The misconfiguration catalogue's minimal bad programs: each builds (step, state, data, run
keyword arguments, world size) whose plan has the problem of its code. Their loss functions count
their calls, so a test can show that nothing was run before the problem was reported."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

import accelfn as af

CALLS = [0]


def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    CALLS[0] += 1
    return F.mse_loss(model(batch[0]), batch[1])


def _data(n: int = 16) -> TensorDataset:
    g = torch.Generator().manual_seed(n)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g))


def _state(model: torch.nn.Module | None = None, **optimizer: Any) -> af.TrainState:
    torch.manual_seed(0)
    model = model if model is not None else torch.nn.Linear(4, 2)
    return af.TrainState.create(model, torch.optim.AdamW([p for p in model.parameters()], **optimizer))


def _step(*transforms: Any) -> af.Step:
    return af.compose(*transforms)(af.train_step(loss_fn))


Case = tuple[af.Step, af.TrainState, Any, dict[str, Any], int]


def scheduler_too_short() -> Case:
    state = _state()
    scheduler = torch.optim.lr_scheduler.OneCycleLR(state.optimizer, max_lr=0.1, total_steps=2)
    return _step(), state.replace(scheduler=scheduler), DataLoader(_data(), batch_size=4), {"epochs": 1}, 1


def scheduler_not_finished() -> Case:  # sized for micro-batches: 4 of them, 2 updates under accumulate(2)
    state = _state()
    scheduler = torch.optim.lr_scheduler.OneCycleLR(state.optimizer, max_lr=0.1, total_steps=4)
    return _step(af.accumulate(2)), state.replace(scheduler=scheduler), DataLoader(_data(), batch_size=4), {}, 1


def drop_last_large() -> Case:
    return _step(), _state(), DataLoader(_data(14), batch_size=8, drop_last=True), {}, 1


def empty_rank() -> Case:
    return _step(), _state(), DataLoader(_data(5), batch_size=8, drop_last=True), {}, 1


def nothing_trainable() -> Case:
    model = torch.nn.Linear(4, 2).requires_grad_(False)
    return _step(), _state(model), DataLoader(_data(), batch_size=4), {}, 1


class _Stream(IterableDataset):
    def __iter__(self) -> Any:
        return iter(_data(1))

    def __len__(self) -> int:
        return 1


def iterable_empty_readers() -> Case:
    return (_step(af.shard_data()), _state(), DataLoader(_Stream(), batch_size=1, num_workers=2),
            {"epochs": None, "max_steps": 3}, 1)


def resume_beyond_epoch() -> Case:
    return _step(), _state().replace(epoch_micro_step=9), DataLoader(_data(), batch_size=4), {}, 1


def sampler_unshardable() -> Case:
    sampler = WeightedRandomSampler([1.0] * 16, 16)
    return _step(af.shard_data()), _state(), DataLoader(_data(), batch_size=4, sampler=sampler), {}, 1


def sharding_unsupported() -> Case:
    return _step(af.shard_params(offload=True)), _state(), DataLoader(_data(), batch_size=4), {}, 1


def data_unshardable() -> Case:
    batches = [(torch.randn(4, 4), torch.randn(4, 2))] * 3
    return _step(af.shard_data(split_batches=True)), _state(), batches, {}, 1


def param_not_in_optimizer() -> Case:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    state = af.TrainState.create(model, torch.optim.SGD(model[1].parameters(), lr=0.1))
    return _step(), state, DataLoader(_data(), batch_size=4), {}, 1


def frozen_weight_decay() -> Case:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    return _step(), _state(model, weight_decay=0.1), DataLoader(_data(), batch_size=4), {}, 1


def shard_params_one_process() -> Case:
    return _step(af.shard_params()), _state(), DataLoader(_data(), batch_size=4), {}, 1


def accumulate_longer_than_epoch() -> Case:
    return _step(af.accumulate(8)), _state(), DataLoader(_data(), batch_size=4), {}, 1


def nothing_to_train() -> Case:
    return _step(), _state().replace(step=10), DataLoader(_data(), batch_size=4), {"max_steps": 10}, 1


class _Closure(torch.optim.Optimizer):
    """An optimizer whose step reads a value on the host (as Adafactor, LBFGS)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["norm"] = p.grad.norm()
                    p.data.add_(p.grad, alpha=-group["lr"] / max(p.grad.norm().item(), 1.0))


def optimizer_unplanned() -> Case:
    model = torch.nn.Linear(4, 2)
    return _step(), af.TrainState.create(model, _Closure(model.parameters())), DataLoader(_data(), batch_size=4), {}, 1


def global_batch_indivisible() -> Case:
    return (_step(af.shard_data(split_batches=True), af.replicate()), _state(), DataLoader(_data(), batch_size=5),
            {}, 2)


def shard_size_indivisible() -> Case:
    return _step(af.shard_data(), af.shard_params(shard_size=3)), _state(), DataLoader(_data(), batch_size=4), {}, 2


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.blocks[1].weight = self.blocks[0].weight  # tied across two units
        self.out = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks[1](self.blocks[0](x)))


def tied_weights_split() -> Case:
    return _step(af.shard_data(), af.shard_params()), _state(_Tied()), DataLoader(_data(), batch_size=4), {}, 2


class _Unused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.spare = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def unused_parameters() -> Case:
    return _step(af.shard_data(), af.replicate()), _state(_Unused()), DataLoader(_data(), batch_size=4), {}, 2


def exceeds_device_memory() -> Case:
    return (_step(af.shard_data(), af.replicate()), _state(torch.nn.Linear(4, 2)), DataLoader(_data(), batch_size=4),
            {"device_memory": 100}, 2)


def padding_large() -> Case:
    return _step(af.shard_data(), af.replicate()), _state(), DataLoader(_data(5), batch_size=2), {}, 4


def replicate_without_shard_data() -> Case:
    return _step(af.replicate()), _state(), DataLoader(_data(), batch_size=4), {}, 2


def shard_data_alone() -> Case:
    return _step(af.shard_data()), _state(), DataLoader(_data(), batch_size=4), {}, 2


def meta_model() -> Case:  # neither shard_params nor tensor_parallel: prepare would not fill it
    with torch.device("meta"):
        model = torch.nn.Linear(4, 2)
    return _step(af.shard_data()), _state(model), DataLoader(_data(), batch_size=4), {}, 1


#: code -> (builder, error?)
CATALOGUE: dict[str, tuple[Callable[[], Case], bool]] = {
    "scheduler-too-short": (scheduler_too_short, True),
    "drop-last-large": (drop_last_large, True),
    "empty-rank": (empty_rank, True),
    "nothing-trainable": (nothing_trainable, True),
    "iterable-empty-readers": (iterable_empty_readers, True),
    "resume-beyond-epoch": (resume_beyond_epoch, True),
    "sampler-unshardable": (sampler_unshardable, True),
    "shard-params-unsupported": (sharding_unsupported, True),
    "data-unshardable": (data_unshardable, True),
    "global-batch-indivisible": (global_batch_indivisible, True),
    "shard-size-indivisible": (shard_size_indivisible, True),
    "tied-weights-split": (tied_weights_split, True),
    "unused-parameters": (unused_parameters, True),
    "exceeds-device-memory": (exceeds_device_memory, True),
    "scheduler-not-finished": (scheduler_not_finished, False),
    "param-not-in-optimizer": (param_not_in_optimizer, False),
    "frozen-weight-decay": (frozen_weight_decay, False),
    "shard-params-one-process": (shard_params_one_process, False),
    "accumulate-longer-than-epoch": (accumulate_longer_than_epoch, False),
    "nothing-to-train": (nothing_to_train, False),
    "optimizer-unplanned": (optimizer_unplanned, False),
    "padding-large": (padding_large, False),
    "replicate-without-shard-data": (replicate_without_shard_data, False),
    "shard-data-alone": (shard_data_alone, False),
    "meta-model": (meta_model, False),
}
#: the codes run itself cannot see: they need the traced micro-batch or the device's memory
PLAN_ONLY = {"unused-parameters", "exceeds-device-memory"}


def run_case(code: str, backend: af.backends.Backend) -> dict[str, Any]:
    """Runs the case through ``af.run`` with plan warnings as errors: what it raised, and how
    many times ``loss_fn`` was called before."""
    import warnings

    step, state, data, kwargs, _ = CATALOGUE[code][0]()
    kwargs.pop("device_memory", None)
    CALLS[0] = 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", af.PlanWarning)
            af.run(step, state, data, backend=backend, progress=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - what it raised is the result
        return {"raised": type(e).__name__, "message": str(e), "calls": CALLS[0]}
    return {"raised": None, "message": "", "calls": CALLS[0]}
