"""Worker for tests/loop/test_plan*.py: the 2- and 4-process checks of ``af.plan``, as pooled scenarios.

``counts()``: for every case of ``planning.TWO_PROCESSES``, this rank's planned counts and what
``run`` did (samples read, updates per epoch, scheduler steps).
"""

from __future__ import annotations

from typing import Any

import accelfn as af
from tests.helpers import planning


def counts() -> dict[str, Any]:
    backend = af.backends.auto()
    return {case.id: planning.planned_and_run(case, backend) for case in planning.TWO_PROCESSES}


def memory() -> dict[str, Any]:
    """``planning.MEMORY_TWO``: this rank's planned and real persistent bytes per case."""
    backend = af.backends.auto()
    return {"-".join(case): planning.planned_and_measured(*case, backend) for case in planning.MEMORY_TWO}


def memory_four() -> dict[str, Any]:
    """``planning.MEMORY_FOUR`` on 4 processes: this rank's planned and real persistent bytes per case."""
    backend = af.backends.auto()
    return {"-".join(case): planning.planned_and_measured(*case, backend) for case in planning.MEMORY_FOUR}


class _Record:
    """A tracker, so that run reduces the metrics at every logged update."""

    def log(self, metrics: Any, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def _instrumented(calls: list[Any]) -> Any:
    """Patches the torch.distributed functions the run's collectives go through (DTensor's
    functional all-reduce too), and DDP (a comm
    hook reporting each bucket, then all-reducing it as DDP's default does); returns an undo."""
    import torch
    import torch.distributed as dist

    from accelfn.distributed import ddp as ddp_module

    saved = {name: getattr(dist, name) for name in
             ("all_reduce", "all_gather_single", "reduce_scatter_single", "broadcast", "_broadcast_coalesced")}

    def record(kind: str, tensor: torch.Tensor) -> None:
        calls.append([kind, str(tensor.dtype), tensor.numel()])

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        record("all_reduce", tensor)
        return saved["all_reduce"](tensor, *args, **kwargs)

    def all_gather_single(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        record("all_gather", output)  # FSDP2's all-gather of a unit (the whole gathered tensor)
        return saved["all_gather_single"](output, input, *args, **kwargs)

    def reduce_scatter_single(*, output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
        record("reduce_scatter", input)  # FSDP2's reduce-scatter of a unit (the whole input)
        return saved["reduce_scatter_single"](output=output, input=input, **kwargs)

    def broadcast(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        record("broadcast", tensor)
        return saved["broadcast"](tensor, *args, **kwargs)

    def broadcast_coalesced(group: Any, tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        by_dtype: dict[Any, int] = {}
        for t in tensors:
            by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.numel()
        calls.extend(["broadcast", str(d), n] for d, n in by_dtype.items())
        return saved["_broadcast_coalesced"](group, tensors, *args, **kwargs)

    import torch.distributed._functional_collectives as funcol

    functional_all_reduce = funcol.all_reduce

    def all_reduce_functional(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        record("all_reduce", tensor)  # DTensor's Partial -> Replicate (fp8's amax of all weights)
        return functional_all_reduce(tensor, *args, **kwargs)

    funcol.all_reduce = all_reduce_functional
    for name, fn in (("all_reduce", all_reduce), ("all_gather_single", all_gather_single),
                     ("reduce_scatter_single", reduce_scatter_single), ("broadcast", broadcast),
                     ("_broadcast_coalesced", broadcast_coalesced)):
        setattr(dist, name, fn)

    ddp = ddp_module.DistributedDataParallel

    def bucket_hook(state: Any, bucket: Any) -> Any:
        buffer = bucket.buffer()
        record("all_reduce", buffer)
        buffer.div_(dist.get_world_size())
        return saved["all_reduce"](buffer, async_op=True).get_future().then(lambda f: f.value()[0])

    # DDP checks the annotations themselves (strings under `from __future__ import annotations`)
    bucket_hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                   "return": torch.futures.Future[torch.Tensor]}

    class Recording(ddp):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.register_comm_hook(None, bucket_hook)

    ddp_module.DistributedDataParallel = Recording

    def undo() -> None:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        funcol.all_reduce = functional_all_reduce
        ddp_module.DistributedDataParallel = ddp

    return undo


def comms() -> dict[str, Any]:
    """For each program of ``planning.COMMS``: the plan's collectives of one update and one log,
    and the collectives the run issued between its 2nd and 3rd optimizer steps (the 3rd update and
    the 2nd update's log)."""
    import warnings

    backend = af.backends.auto()
    out = {}
    for name in planning.COMMS:
        step, state, loader = planning.comms_program(name), planning.comms_state(name), planning.memory_loader()
        plan = af.plan(step, state, loader, backend=backend)
        calls: list[Any] = []
        state.optimizer.register_step_pre_hook(lambda *a: calls.append("UPDATE"))
        undo = _instrumented(calls)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                af.run(step, state, loader, backend=backend, epochs=None, max_steps=4, progress=False,
                       trackers=[_Record()])
        finally:
            undo()
        marks = [i for i, c in enumerate(calls) if c == "UPDATE"]
        out[name] = {
            "planned": [[c.kind, str(c.dtype), c.elements] for c in plan.comms for _ in range(c.count)],
            "windows": [calls[a + 1:b] for a, b in zip(marks, marks[1:])],
        }
    return out


def catalogue() -> dict[str, Any]:
    """The 2-process error cases of ``bad_programs.CATALOGUE`` through ``af.run`` on both ranks."""
    from tests.helpers import bad_programs

    backend = af.backends.auto()
    return {code: bad_programs.run_case(code, backend) for code, (build, error) in bad_programs.CATALOGUE.items()
            if error and build()[4] == 2 and code not in bad_programs.PLAN_ONLY}
