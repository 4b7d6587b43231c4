"""Programs for the plan tests, and what ``run`` really did with them, shared by the
single-process tests and the 2-process worker ``tests/workers/plan_checks.py``.

A case's dataset carries each sample's index, so the loss function records, per rank and
epoch, exactly which samples the run read; a hook marks each epoch's end; a constant
LambdaLR counts the scheduler's steps.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import accelfn as af
from tests.helpers import launch as _launch

EPOCHS = 2


@attrs.frozen
class Case:
    """One combination: data size, batch size, DataLoader drop_last, sharding, accumulation, limits."""

    size: int
    batch: int = 4
    loader_drop: bool = False
    shard: str | None = "pad"  # None | "pad" | "drop_last" | "uneven" | "split"
    n: int = 1
    max_steps: int | None = None
    epochs: int = EPOCHS
    resume_at: int = 0  # micro-batches trained by hand before run (a state part-way through)

    @property
    def id(self) -> str:
        drop = "droplast" if self.loader_drop else "keeplast"
        stop = f"-max{self.max_steps}" if self.max_steps else ""
        resume = f"-resume{self.resume_at}" if self.resume_at else ""
        return f"n{self.size}-b{self.batch}-{drop}-{self.shard or 'noshard'}-acc{self.n}{stop}{resume}"


def program(case: Case, world_size: int) -> tuple[af.Step, DataLoader]:
    """The case's program and DataLoader (indices as the third tensor of each batch)."""
    g = torch.Generator().manual_seed(case.size)
    data = TensorDataset(torch.randn(case.size, 2, generator=g), torch.randn(case.size, 1, generator=g),
                         torch.arange(case.size))
    transforms: list[Any] = [af.accumulate(case.n)] if case.n > 1 else []
    if case.shard is not None:
        transforms.append(af.shard_data(drop_last=case.shard == "drop_last", even_batches=case.shard != "uneven",
                                        split_batches=case.shard == "split"))
        if case.shard != "uneven":
            transforms.append(af.replicate())
    seen: list[list[int]] = [[]]

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        seen[-1].extend(batch[2].tolist())
        return F.mse_loss(model(batch[0]), batch[1])

    step = af.compose(*transforms)(af.train_step(loss_fn))
    loader = DataLoader(data, batch_size=case.batch, shuffle=case.shard is not None, drop_last=case.loader_drop)
    loader.seen = seen  # type: ignore[attr-defined]  # what loss_fn read, one list per epoch
    return step, loader


def fresh_state() -> af.TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return af.TrainState.create(model, optimizer, scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))


def planned_and_run(case: Case, backend: af.backends.Backend) -> dict[str, Any]:
    """The plan's counts for this rank and the job, and what ``run`` did on this rank."""
    step, loader = program(case, backend.world_size)
    state = fresh_state()
    if case.resume_at:  # train by hand to a position part-way through the first epoch
        state, step_fn = backend.prepare(step, state)
        for batch, last in backend.batches(loader, step, 0):
            state, _ = step_fn(state, batch, flush=last)
            if state.micro_step == case.resume_at:
                break
        loader.seen[:] = [[]]  # type: ignore[attr-defined]
    plan = af.plan(step, state, loader, backend=backend, epochs=case.epochs, max_steps=case.max_steps, trace=False)
    ends: list[int] = []

    def epoch_end(s: af.TrainState, b: Any) -> None:
        ends.append(s.step)
        loader.seen.append([])  # type: ignore[attr-defined]

    start = state.step
    with warnings.catch_warnings():  # the plan's own warnings (padding, ...) are not this test's subject
        warnings.simplefilter("ignore")
        state = af.run(step, state, loader, backend=backend, epochs=case.epochs, max_steps=case.max_steps,
                       progress=False, hooks=[af.Hook(epoch_end, at_epoch_end=True)])
    seen = [s for s in loader.seen if s]  # type: ignore[attr-defined]
    updates = [b - a for a, b in zip([start, *ends], ends)]
    if state.step != (ends[-1] if ends else start):
        updates.append(state.step - (ends[-1] if ends else start))  # an epoch that max_steps cut
    r = backend.rank
    return {
        "planned": {
            "updates": [u for e in plan.epochs for u in [e.updates[r]] * e.num_epochs],
            "samples": [s for e in plan.epochs for s in [e.samples[r]] * e.num_epochs],
            "padded_job": [p for e in plan.epochs for p in [sum(e.padded)] * e.num_epochs],
            "dropped": [d for e in plan.epochs for d in [e.dropped] * e.num_epochs],
            "total": plan.total_updates, "scheduler": plan.scheduler_steps,
        },
        "run": {"updates": updates, "samples": [len(s) for s in seen], "indices": seen,
                "total": state.step, "scheduler": state.scheduler.last_epoch},
    }


def unique_dropped_padded(results: list[dict[str, Any]], size: int) -> tuple[list[int], list[int]]:
    """Per epoch over all ranks' results: (samples no rank read, samples read more than once)."""
    epochs = len(results[0]["run"]["indices"])
    dropped, padded = [], []
    for e in range(epochs):
        read = [i for r in results for i in r["run"]["indices"][e]]
        dropped.append(size - len(set(read)))
        padded.append(len(read) - len(set(read)))
    return dropped, padded


#: one-process cases (23, 25 and 8 samples; every sharding; accumulate 1 to 5; max_steps; resumed)
ONE_PROCESS = [
    Case(23), Case(23, loader_drop=True), Case(25, shard=None, n=3), Case(25, shard="drop_last", n=2),
    Case(23, n=3), Case(23, n=5, loader_drop=True), Case(25, n=4, max_steps=5), Case(8, n=5),
    Case(23, shard="split", n=2), Case(23, shard="uneven", n=3), Case(25, shard=None, loader_drop=True, n=2),
    Case(23, n=3, resume_at=4), Case(25, n=2, resume_at=3, max_steps=9), Case(23, batch=5, n=4, max_steps=3),
]
#: two-process cases (odd sizes leave padding, drop_last tails and partial windows)
TWO_PROCESSES = [
    Case(23), Case(23, loader_drop=True, n=3), Case(25, shard="drop_last", n=2), Case(25, shard="drop_last",
                                                                                      loader_drop=True),
    Case(23, shard="uneven", n=3), Case(25, shard="uneven", loader_drop=True), Case(23, shard="split", batch=6, n=2),
    Case(25, shard="split", batch=4, loader_drop=True), Case(21, n=5), Case(25, n=4, max_steps=3),
    Case(23, n=2, max_steps=6), Case(23, n=3, resume_at=2), Case(25, shard="drop_last", n=3, resume_at=2),
    Case(7, batch=2, n=2),
]
#: sharding cases checked on 3 and 4 ranks against the data path ``run`` reads (epoch_batches)
MANY_RANKS = [Case(23), Case(23, loader_drop=True), Case(25, shard="drop_last"), Case(26, shard="uneven"),
              Case(23, shard="split", batch=12), Case(26, shard="split", batch=12, loader_drop=True), Case(5, batch=2),
              Case(10, shard="drop_last", batch=3, loader_drop=True)]


class Net(torch.nn.Module):
    """Odd row counts (5, 7: uneven shards on 2 and 4 ranks), repeated blocks (shard_params units),
    buffers (float and int, as a BatchNorm's) and a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(3, 7)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(7, 7), torch.nn.Tanh()) for _ in range(2))
        self.register_buffer("shift", torch.zeros(7))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.out = torch.nn.Linear(7, 5)
        self.scale = torch.nn.Parameter(torch.ones(5), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h + self.shift.to(h.dtype)) * self.scale


#: (optimizer, transforms) of the memory cases; the precision policies are added per test
MEMORY_OPTIMIZERS = ("adamw", "sgd")


def memory_state(optimizer: str) -> af.TrainState:
    torch.manual_seed(0)
    model = Net()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = (torch.optim.AdamW(trainable, lr=1e-3) if optimizer == "adamw"
           else torch.optim.SGD(trainable, lr=0.1, momentum=0.9))
    return af.TrainState.create(model, opt)


def memory_program(parallel: str | None, precision: str) -> af.Step:
    transforms: list[Any] = [af.shard_data(), af.with_precision(precision)]
    if parallel == "replicate":
        transforms.append(af.replicate())
    elif parallel == "shard_params":
        transforms.append(af.shard_params())
    elif parallel == "hybrid":  # sharded over pairs of ranks, replicated across the pairs
        transforms.append(af.shard_params(shard_size=2))
    return af.compose(*transforms)(af.train_step(lambda m, b: F.mse_loss(m(b[0]).float(), b[1])))


def memory_loader() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    return DataLoader(TensorDataset(torch.randn(32, 3, generator=g), torch.randn(32, 5, generator=g)), batch_size=4)


def _local_bytes(t: Any) -> int:
    if not isinstance(t, torch.Tensor):
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def planned_and_measured(parallel: str | None, precision: str, optimizer: str,
                         backend: af.backends.Backend) -> dict[str, dict[str, int]]:
    """This rank's planned persistent bytes, and the real state's after the first update
    (gradients: measured just before the optimizer step, which ``zero_grad`` follows)."""
    step, state, loader = memory_program(parallel, precision), memory_state(optimizer), memory_loader()
    memory = af.plan(step, state, loader, backend=backend, trace=False).memory[backend.rank]
    grads: list[int] = []

    def before_update(optimizer: torch.optim.Optimizer, *args: Any) -> None:
        grads.append(sum(_local_bytes(p.grad) for g in optimizer.param_groups for p in g["params"]))

    state.optimizer.register_step_pre_hook(before_update)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = af.run(step, state, loader, backend=backend, max_steps=1, progress=False)
    model = state.model
    measured = {"params": sum(_local_bytes(p) for p in model.parameters()), "grads": grads[0],
                "optimizer": sum(_local_bytes(v) for s in state.optimizer.state.values() for v in s.values()),
                "buffers": sum(_local_bytes(b) for b in model.buffers())}
    planned = {k: getattr(memory, k) for k in measured}
    return {"planned": planned, "measured": measured}


#: the 2-process memory cases: (parallel, precision, optimizer)
MEMORY_TWO = [(p, precision, o) for p in ("replicate", "shard_params") for precision in ("fp32", "bf16", "fp16",
                                                                                         "bf16-true")
              for o in MEMORY_OPTIMIZERS if (precision, o) != ("bf16-true", "sgd") or p == "replicate"]


#: the 4-process memory cases (uneven shards: rows 7 and 5 cut 2+2+2+1 and 2+2+1+0)
MEMORY_FOUR = [("shard_params", precision, "adamw") for precision in ("fp32", "bf16", "fp16")] + [
    ("shard_params", "fp32", "sgd"), ("hybrid", "bf16", "adamw"), ("replicate", "fp16", "adamw")]


#: the programs whose collectives are checked on 2 processes
COMMS = ("replicate-acc4-clip", "replicate-buckets", "shard_params-clip", "shard_params-acc2-fp16",
         "shard_params-fp8")


def comms_program(name: str) -> af.Step:
    loss = af.train_step(lambda m, b: F.mse_loss(m(b[0]).float(), b[1]))
    transforms: dict[str, list[Any]] = {
        "replicate-acc4-clip": [af.replicate(), af.accumulate(4), af.clip(1.0)],
        "replicate-buckets": [af.replicate(bucket_cap_mb=0.0002)],  # 209 bytes: several buckets
        "shard_params-clip": [af.shard_params(), af.clip(1.0)],
        "shard_params-acc2-fp16": [af.shard_params(), af.accumulate(2), af.with_precision("fp16")],
        "shard_params-fp8": [af.shard_params(), af.with_precision("fp8", float8_all_gather=True)],
    }
    return af.compose(af.shard_data(), *transforms[name])(loss)


class Fp8Net(torch.nn.Module):
    """``3 -> 32``, two ``Linear(32, 32)`` blocks (converted to float8: multiples of 16) and
    ``32 -> 5``: the input and output layers stay in high precision."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(3, 32)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh()) for _ in range(2))
        self.out = torch.nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def comms_state(name: str) -> af.TrainState:
    """The state of the comms program ``name``: ``memory_state("adamw")``, or for fp8 the same
    over ``Fp8Net`` (layers that suit float8)."""
    if not name.endswith("fp8"):
        return memory_state("adamw")
    torch.manual_seed(0)
    model = Fp8Net()
    return af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=1e-3))


def _example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"{name}_plan_example", _launch.ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Items(Dataset):
    def __init__(self, items: list[Any]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


#: the examples whose traced micro-batch peak is checked against a real one (CPU and CUDA)
EXAMPLES = ("digits", "byte_lm", "hf_gpt2")


def example_case(name: str) -> tuple[torch.nn.Module, Any, DataLoader, str]:
    """An example's model, loss function, a DataLoader of random batches of its shapes and its
    precision: the digits CNN (16 images), the byte LM (its config's batch, bf16), the HF GPT-2."""
    torch.manual_seed(0)
    if name == "digits":
        module = _example("digits")
        items = [(torch.rand(1, 8, 8), torch.tensor(i % 10)) for i in range(64)]
        return module.Net(), module.loss_fn, DataLoader(_Items(items), batch_size=16), "fp32"
    if name == "byte_lm":
        module = _example("byte_lm")
        config = module.Config()
        items = [(torch.randint(0, 256, (config.context,)), torch.randint(0, 256, (config.context,)))
                 for _ in range(32)]
        return module.ByteLM(config), module.loss_fn, DataLoader(_Items(items), batch_size=config.batch_size), "bf16"
    module = _example("hf_gpt2")
    items = [{"input_ids": (ids := torch.randint(0, 256, (64,))), "labels": ids} for _ in range(16)]
    return module.gpt2(64), module.loss_fn, DataLoader(_Items(items), batch_size=8), "fp32"


# -- one program per parallelism: the plan made in one process against the real run ------------

class Wide(torch.nn.Module):
    """A layer split column-wise and one row-wise under tensor parallelism (rows 9: uneven on 2 and 4 ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(3, 18)
        self.down = torch.nn.Linear(18, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class Deep(torch.nn.Module):
    """A residual stack a pipeline cuts before ``blocks.1`` (a buffer, as a BatchNorm's, with stage 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(3, 6)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(3))
        self.out = torch.nn.Linear(6, 1)
        self.register_buffer("shift", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) + self.shift
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.out(h)


def _mse(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def _output_mse(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, targets)


#: pipeline()'s loss form: from the last stage's output and the micro-batch's targets
_stage_mse = af.output_loss(_output_mse)


#: name -> (processes, transforms, model, loss): one row per parallelism of docs/13's table
PARALLEL: dict[str, tuple[int, Any, type[torch.nn.Module], Any]] = {
    "tensor_parallel-2": (2, lambda: [af.tensor_parallel({"up": "colwise", "down": "rowwise"}, size=2), af.clip(1.0),
                                      af.accumulate(2)], Wide, _mse),
    "tensor_parallel-4": (4, lambda: [af.tensor_parallel({"up": "colwise", "down": "rowwise"}, size=2),
                                      af.accumulate(2), af.with_precision("bf16")], Wide, _mse),
    "fsdp-x-tp-2x2": (4, lambda: [af.shard_params(), af.tensor_parallel({"up": "colwise", "down": "rowwise"}, size=2),
                                  af.clip(1.0), af.accumulate(2)], Wide, _mse),
    "pipeline-2": (2, lambda: [af.pipeline(["blocks.1"], size=2), af.accumulate(2), af.clip(1.0)], Deep, _stage_mse),
    "pipeline-4": (4, lambda: [af.pipeline(["blocks.1"], size=2, schedule="gpipe"), af.accumulate(2)], Deep,
                   _stage_mse),
    "pipeline-x-replicate": (4, lambda: [af.pipeline(["blocks.1"], size=2), af.replicate(), af.accumulate(2),
                                         af.clip(1.0)], Deep, _stage_mse),
    "invariant-2": (2, lambda: [af.invariant(), af.replicate(), af.accumulate(2), af.clip(1.0)], Wide, _mse),
    "replicate-fp16-hook": (2, lambda: [af.replicate(comm_hook=_fp16_hook())], Wide, _mse),
    "zero-1": (2, lambda: [af.deepspeed({"zero_optimization": {"stage": 1}}), af.accumulate(2), af.clip(1.0)],
               Wide, _mse),
    "zero-2": (2, lambda: [af.deepspeed({"zero_optimization": {"stage": 2}}), af.accumulate(2),
                           af.with_precision("bf16")], Wide, _mse),
    "zero-3": (2, lambda: [af.deepspeed({"zero_optimization": {"stage": 3}}), af.clip(1.0)], Wide, _mse),
    "zero-0": (2, lambda: [af.deepspeed({"zero_optimization": {"stage": 0}}), af.clip(1.0)], Wide, _mse),
    "zero-3-offload": (2, lambda: [af.deepspeed({"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"}}}), af.accumulate(2)], Wide, _mse),
}
#: the rows that need DeepSpeed
DEEPSPEED_ROWS = ("zero-1", "zero-2", "zero-3", "zero-0", "zero-3-offload")
PARALLEL_EPOCHS = 2


def _fp16_hook() -> Any:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.fp16_compress_hook


def parallel_program(name: str) -> tuple[af.Step, af.TrainState, DataLoader]:
    """Row ``name`` of :data:`PARALLEL`: its program, a fresh state (AdamW, a constant LambdaLR
    that counts the scheduler's steps) and its DataLoader (62 samples of 4: a last batch of 2)."""
    _, transforms, model_type, loss = PARALLEL[name]
    torch.manual_seed(0)
    model = model_type()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = af.TrainState.create(model, optimizer,
                                 scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))
    step = af.compose(af.shard_data(), *transforms())(af.train_step(loss))
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(62, 3, generator=g), torch.randn(62, 1, generator=g))
    return step, state, DataLoader(data, batch_size=4, shuffle=True)
