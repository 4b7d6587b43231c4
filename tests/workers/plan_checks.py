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


# -- one program per parallelism (tests/loop/test_plan_parallelisms.py) -------------------------

#: the c10d and functional-collective operators a run issues, by the plan's kinds; the element
#: count is the whole tensor's (the gathered or scattered one), as ``Collective.elements`` counts
_KINDS = {"allreduce_": "all_reduce", "all_reduce": "all_reduce", "_allgather_base_": "all_gather",
          "allgather_": "all_gather", "all_gather_into_tensor": "all_gather",
          "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
          "broadcast_": "broadcast", "send": "send", "recv_": "recv"}


def _recorder(calls: list[Any], flat_bytes: int = 0) -> Any:
    """A dispatch mode that records each collective the run issues (torch.distributed's c10d
    operators, DTensor's functional collectives, DDP's and FSDP2's, DeepSpeed's, point to point),
    seen from every thread the process computes on (autograd's included); with ``flat_bytes``,
    it also counts the storages of that many bytes alive at once (``most``: invariant's flat
    gradient buffers), each from the operator that made it until Python frees it."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Recorder(TorchDispatchMode):
        alive: dict[int, Any] = {}
        most = 0

        def _count(self, out: Any) -> None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() == flat_bytes:
                    st = t.untyped_storage()
                    key = id(st)
                    if key not in self.alive:
                        self.alive[key] = weakref.ref(st, lambda _, key=key: self.alive.pop(key, None))
            Recorder.most = max(Recorder.most, len(self.alive))

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if flat_bytes:
                out = func(*args, **kwargs)
                self._count(out)
                self._record(func, args, kwargs)
                return out
            self._record(func, args, kwargs)
            return func(*args, **kwargs)

        def _record(self, func: Any, args: Any, kwargs: Any) -> None:
            name = func.__name__.split(".")[0]
            if func.namespace in ("c10d", "_c10d_functional") and name in _KINDS:
                tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
                if name == "allgather_":  # (outputs per rank, inputs): the gathered whole
                    numel = sum(t.numel() for t in tree_flatten(args[0])[0])
                elif name == "all_gather_into_tensor":  # (input, group size, group): the gathered whole
                    numel = tensors[0].numel() * int(args[1])
                elif name == "_reduce_scatter_base_":  # (output, input): the whole input
                    numel = tensors[1].numel()
                else:
                    numel = tensors[0].numel()
                calls.append([_KINDS[name], str(tensors[0].dtype), numel])

    return Recorder()


def _held_bytes(state: Any) -> dict[str, int]:
    """This rank's parameter bytes (a DTensor's local piece; DeepSpeed ZeRO-3's partition
    ``ds_tensor`` besides the parameter's own data, whole for a persistent one) and optimizer bytes
    (its state tensors, and DeepSpeed's fp32 master partitions where they are not the parameters'
    own storage)."""
    import torch

    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    params = list(state.model.parameters())
    tensors = [local(p) for p in params] + [p.ds_tensor for p in params if hasattr(p, "ds_tensor")]
    held = sum(t.numel() * t.element_size() for t in tensors)
    optimizer = sum(local(v).numel() * local(v).element_size() for s in state.optimizer.state.values()
                    for v in s.values() if isinstance(v, torch.Tensor))
    engine = getattr(state.model, "_accelfn_deepspeed_engine", None)
    if engine is not None:
        inner = engine.optimizer
        masters = getattr(inner, "single_partition_of_fp32_groups", None) or getattr(
            inner, "fp32_partitioned_groups_flat", [])
        storages = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
        optimizer += sum(m.numel() * m.element_size() for m in masters
                         if m.untyped_storage().data_ptr() not in storages)
    return {"params": held, "optimizer": optimizer}


def parallelisms(names: list[str]) -> dict[str, Any]:
    """For each row of ``planning.PARALLEL``: what the real run did on this rank: updates per
    epoch, total updates, scheduler steps, parameter and optimizer bytes after the run, and the
    collectives between its 2nd and 3rd optimizer steps (the 3rd update's, the 2nd's log)."""
    import warnings

    backend = af.backends.auto()
    out = {}
    for name in names:
        step, state, loader = planning.parallel_program(name)
        calls: list[Any] = []
        ends: list[int] = []
        state.optimizer.register_step_pre_hook(lambda *a: calls.append("UPDATE"))
        counted = af.count_updates(step, loader, backend=backend, epochs=planning.PARALLEL_EPOCHS).total
        flat = sum(p.numel() * p.element_size() for p in state.model.parameters()) if "invariant" in name else 0
        recorder = _recorder(calls, flat)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with recorder:
                state = af.run(step, state, loader, backend=backend, epochs=planning.PARALLEL_EPOCHS,
                               progress=False, trackers=[_Record()],
                               hooks=[af.Hook(lambda s, b: ends.append(s.step), at_epoch_end=True)])
        marks = [i for i, c in enumerate(calls) if c == "UPDATE"]
        out[name] = {"updates": [b - a for a, b in zip([0, *ends], ends)], "total": state.step, "counted": counted,
                     "partial_sums": recorder.most * flat,
                     "scheduler": state.scheduler.last_epoch, **_held_bytes(state),
                     "window": calls[marks[1] + 1:marks[2]]}
    return out
