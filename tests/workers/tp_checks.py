"""Scenarios of tests/distributed/test_tensor_parallel.py, run on 2 ranks by the worker pool.

``train``: the MLP and the byte LM of ``tests.helpers.tensor_parallel`` under
``shard_data + tensor_parallel(size=2) + clip(1.0)``, 20 AdamW updates each, writing the
gathered parameters to ``OUT/rank{r}.safetensors`` and returning what the tests compare.
``clip_mixed``: clipping gradients that are plain tensors and DTensors on two meshes at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader

import accelfn as af
from accelfn.distributed import grad_norm
from tests.helpers import programs as P
from tests.helpers import tensor_parallel as T
from tests.helpers.tracking import Recorder


def train(out: str) -> dict[str, Any]:
    """Both models trained under TP=2; their gathered parameters saved, the rest returned."""
    backend = af.backends.auto()
    result: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    for kind in ("mlp", "lm"):
        step = af.compose(af.shard_data(seed=P.SHARD_SEED), af.tensor_parallel(T.plan(kind), size=2),
                          af.clip(T.CLIP))(af.train_step(T.loss(kind)))
        recorder = Recorder()
        state = af.run(step, T.make_state(kind), T.loader(kind), backend=backend, epochs=T.EPOCHS,
                       progress=False, trackers=[recorder])
        params = dict(state.model.named_parameters())
        optimizer_params = [p for g in state.optimizer.param_groups for p in g["params"]]
        result[kind] = {
            "step": state.step,
            "grad_norms": [point["grad_norm"] for _, point in recorder.points],
            "samples_per_update": [point["samples_per_s"] / point["updates_per_s"] for _, point in recorder.points],
            "types": {name: type(p.data).__name__ for name, p in params.items()},
            "local_shapes": {name: list(p.to_local().shape) if hasattr(p, "to_local") else list(p.shape)
                             for name, p in params.items()},
            "optimizer_params_are_model_params": [id(p) for p in optimizer_params] == [
                id(p) for p in state.model.parameters()],
        }
        tensors |= {f"{kind}.{k}": v for k, v in T.full_state_dict(state.model).items()}
        if kind == "mlp":  # 40 samples in batches of 3 over one data shard: every sample once, in order
            evaluated = af.evaluate(lambda m, b: m(b[0]), state, DataLoader(T.data(kind), batch_size=3),
                                    backend=backend)
            tensors["evaluated"] = evaluated.contiguous()
    numerics, numeric_tensors = _numerics(backend)
    result["numerics"] = numerics
    save_file(tensors | numeric_tensors, Path(out) / f"rank{backend.rank}.safetensors")
    return result


def _poisoned(loss_fn: Any, rank: int) -> Any:
    """``loss_fn``, except that its ``T.POISONED_UPDATE``-th call on rank 1 leaves an inf in that
    rank's shard of the first layer's weight gradient (rank 0's shard stays finite)."""
    calls = [0]

    def poisoned(model: torch.nn.Module, batch: Any) -> Any:
        calls[0] += 1
        if calls[0] == T.POISONED_UPDATE and rank == 1:
            def poison(param: Any) -> None:
                param.grad._local_tensor[0, 0] = float("inf")
                handle.remove()

            handle = model[0].weight.register_post_accumulate_grad_hook(poison)
        return loss_fn(model, batch)

    return poisoned


def _numerics(backend: af.backends.Backend) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The MLP under TP=2 + clip(1.0) with the transforms that must keep their meaning: an
    af.Loss of ragged item counts over accumulate(2) windows ("items"), fp16 loss scaling and
    skip_nonfinite with an inf gradient on rank 1 only ("fp16", "skip"), and bf16 autocast
    ("bf16"). Returns, per run, what this rank saw (step, loss scale, skips, its copy of the
    replicated bias, rank 0's logged points) and the gathered parameters by ``run.name``."""
    cases: dict[str, tuple[tuple[Any, ...], Any]] = {
        "items": ((af.accumulate(2),), T.weighted_mse),
        "fp16": ((af.with_precision("fp16", init_scale=2.0**8),), _poisoned(P.mse, backend.rank)),
        "skip": ((af.skip_nonfinite(),), _poisoned(P.mse, backend.rank)),
        "bf16": ((af.with_precision("bf16"),), P.mse),
    }
    result: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, (extra, loss_fn) in cases.items():
        step = af.compose(af.shard_data(seed=P.SHARD_SEED), af.tensor_parallel(T.MLP_PLAN, size=2),
                          af.clip(T.CLIP), *extra)(af.train_step(loss_fn))
        recorder = Recorder()
        state = af.run(step, T.make_state("mlp"), T.loader("mlp"), backend=backend, epochs=T.EPOCHS,
                       progress=False, trackers=[recorder])
        points = [point for _, point in recorder.points]
        scale, skips = state.transforms_state.get("loss_scale"), state.transforms_state.get("skips")
        result[name] = {
            "step": state.step,
            "loss_scale": None if scale is None else scale.scale,
            "num_skipped": None if skips is None else skips.num_skipped,
            "bias": state.model[2].bias.to_local().tolist(),  # Replicate: each rank updates its own copy
            "points": [{k: v for k, v in point.items() if k in ("loss", "skipped", "loss_scale", "grad_norm")}
                       | {"items_per_update": point.get("items_per_s", 0.0) / point["updates_per_s"]}
                       for point in points],
        }
        tensors |= {f"{name}.{k}": v for k, v in T.full_state_dict(state.model).items()}
    return result, tensors


def clip_mixed() -> dict[str, Any]:
    """Gradients of 5 parameters on 2 ranks: a plain tensor, a DTensor sharded over the world
    mesh, one replicated over it, one sharded along the tensor dimension of a 2-D ``(1, 2)``
    mesh, and one whose gradient is Partial (a pending sum): their full values are known on
    every rank; returns the norm clip_grad_norm computed, the full norm, and the clipped
    full gradients next to the expected ones."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    backend = af.backends.auto()
    rank = backend.rank
    world = init_device_mesh("cpu", (2,))
    grid = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data", "tensor"))
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(3, 4, generator=g) for _ in range(5)]
    layouts = [None, (world, [Shard(0)]), (world, [Replicate()]), (grid, [Replicate(), Shard(1)]), "partial"]
    params: list[torch.Tensor] = []
    for value, layout in zip(full, layouts):
        if layout is None:
            param = torch.nn.Parameter(torch.zeros(3, 4))
            param.grad = value.clone()
        elif layout == "partial":  # each rank holds half of the sum
            param = torch.nn.Parameter(distribute_tensor(torch.zeros(3, 4), world, [Replicate()]))
            param.grad = DTensor.from_local(value / 2, world, [Partial()], run_check=False)
        else:
            mesh, placements = layout
            param = torch.nn.Parameter(distribute_tensor(torch.zeros(3, 4), mesh, placements))
            param.grad = distribute_tensor(value.clone(), mesh, placements)
        params.append(param)
    expected_norm = float(torch.linalg.vector_norm(torch.cat([v.flatten() for v in full])))
    inf_norm = float(grad_norm.global_norm(params, float("inf"), backend.collective_device))
    norm = float(grad_norm.clip_grad_norm(params, 1.0, 2.0, backend.collective_device))
    clipped = [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for p in params]
    coefficient = min(1.0, 1.0 / (expected_norm + 1e-6))
    return {
        "rank": rank, "norm": norm, "expected_norm": expected_norm, "inf_norm": inf_norm,
        "expected_inf_norm": float(max(v.abs().max() for v in full)),
        "clipped_error": max(float((c - v * coefficient).abs().max()) for c, v in zip(clipped, full)),
        "types": [type(p.grad).__name__ for p in params],
    }


def _optimizer_full(state: af.TrainState, prefix: str) -> dict[str, torch.Tensor]:
    """AdamW's moments of every parameter, gathered whole, by ``prefix + name/key``."""
    names = {id(p): n for n, p in state.model.named_parameters()}
    return {f"{prefix}{names[id(p)]}/{key}": (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for p, entries in state.optimizer.state.items() for key, v in entries.items() if key != "step"}


def checkpoints(out: str, shard: bool = False, max_norm: float = T.CLIP, stop: int = 3) -> dict[str, Any]:
    """The byte LM under TP=2 (with ``shard``: and shard_params(), 2-D FSDP x TP) with
    accumulate(2) + clip(max_norm): a whole run of 2 epochs; a run stopped after ``stop`` updates (mid-epoch)
    with a DCP checkpoint; a fresh state resumed from it; af.save_model of the whole run; and
    af.evaluate of its per-sequence loss. Gathered tensors to ``OUT/ckpt_rank{r}.safetensors``."""
    backend = af.backends.auto()
    extra = (af.shard_params(),) if shard else ()
    step = af.compose(af.shard_data(seed=P.SHARD_SEED), af.tensor_parallel(T.plan("lm"), size=2), af.accumulate(2),
                      af.clip(max_norm), *extra)(af.train_step(T.loss("lm")))
    recorder = Recorder()
    whole = af.run(step, T.make_state("lm"), T.loader("lm"), backend=backend, epochs=T.EPOCHS, progress=False,
                   trackers=[recorder])
    params = dict(whole.model.named_parameters())
    keep = af.Checkpoints(Path(out) / "ckpt", every_steps=stop)
    stopped = af.run(step, T.make_state("lm"), T.loader("lm"), backend=backend, epochs=T.EPOCHS, max_steps=stop,
                     checkpoints=keep, progress=False)
    tensors = ({f"whole.{k}": v for k, v in T.full_state_dict(whole.model).items()}
               | {f"stopped.{k}": v for k, v in T.full_state_dict(stopped.model).items()}
               | _optimizer_full(stopped, "stopped_optimizer.") | _optimizer_full(whole, "whole_optimizer."))
    torch.manual_seed(123)  # another start: rank 0's broadcast and the checkpoint decide
    resumed = af.run(step, T.make_state("lm"), T.loader("lm"), backend=backend, epochs=T.EPOCHS,
                     checkpoints=keep, resume="auto", progress=False)
    tensors |= {f"resumed.{k}": v for k, v in T.full_state_dict(resumed.model).items()}
    tensors |= _optimizer_full(resumed, "resumed_optimizer.")
    af.save_model(whole, Path(out) / "export", backend=backend)
    # each sequence's loss once, in order, on every rank (a group reads one data shard; ragged last batches)
    tensors["evaluated"] = af.evaluate(T.byte_lm().per_sequence_loss, whole, DataLoader(T.data("lm"), batch_size=3),
                                       backend=backend).contiguous()
    save_file(tensors, Path(out) / f"ckpt_rank{backend.rank}.safetensors")
    return {"steps": [whole.step, stopped.step, resumed.step], "stopped_epoch_micro_step": stopped.epoch_micro_step,
            "grad_norms": [point["grad_norm"] for _, point in recorder.points],
            "losses": [point["loss"] for _, point in recorder.points],
            "samples_per_update": [point["samples_per_s"] / point["updates_per_s"] for _, point in recorder.points],
            "local_numel": {name: p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                            for name, p in params.items()},
            "full_numel": {name: p.numel() for name, p in params.items()},
            "meshes": sorted({str(getattr(p, "device_mesh", None)) for p in params.values()}),
            "model_type": type(whole.model).__name__}


def auto() -> dict[str, Any]:
    """A tiny transformers Llama split by its own plan (tensor_parallel("auto", size=2)): the
    largest difference of its logits from the unsplit model's, and what rank 0 holds of q_proj."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=16)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    expected = reference(tokens).logits
    backend = af.backends.auto()
    step = af.tensor_parallel("auto", size=2)(af.train_step(lambda m, b: m(b).logits.float().mean()))
    state, _ = backend.prepare(step, af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1)))
    with torch.no_grad():
        logits = state.model(tokens).logits
    q = state.model.model.layers[0].self_attn.q_proj.weight
    return {"max_diff": float((logits - expected).abs().max()), "q_local": list(q.to_local().shape),
            "q_full": list(q.shape), "embed_local": list(state.model.model.embed_tokens.weight.to_local().shape),
            "lm_head_local": list(state.model.lm_head.weight.to_local().shape)} | _other_plans(backend)


def _other_plans(backend: af.backends.Backend) -> dict[str, Any]:
    """The other documented plan forms on 2 ranks, each against the unsplit model: a dict with
    the ``"sequence_parallel"`` style and ParallelStyle objects (Megatron's sequence parallelism:
    the row-wise layer reduce-scatters along the sequence, the LayerNorm runs on sequence
    shards), trained 3 SGD updates through ``af.run``; and a plan function
    ``parallelize(model, mesh)``, given the group's 1-D mesh."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8),
                                   torch.nn.LayerNorm(8))

    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(2, 4, 8, generator=g) for _ in range(3)]  # (batch, seq 4 = 2 shards of 2, width)

    def full(out: torch.Tensor) -> torch.Tensor:  # the LayerNorm's output is a DTensor sharded along seq
        return out.full_tensor() if hasattr(out, "full_tensor") else out

    def sp_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return full(model(batch)).pow(3).mean()

    reference = make()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for batch in batches:
        sp_loss(reference, batch).backward()
        opt.step()
        opt.zero_grad()
    plan = {"0": "colwise", "2": RowwiseParallel(output_layouts=Shard(1)), "3": "sequence_parallel"}
    sp_model = make()
    sp = af.run(af.tensor_parallel(plan, size=2)(af.train_step(sp_loss)),
                af.TrainState.create(sp_model, torch.optim.SGD(sp_model.parameters(), lr=0.1)), batches,
                backend=backend, progress=False)
    sp_diff = max(float((full(sp.model.state_dict()[k]) - v).abs().max()) for k, v in reference.state_dict().items())

    meshes = []

    def parallelize(module: torch.nn.Module, mesh: Any) -> None:
        meshes.append((mesh.ndim, mesh.size(), mesh.mesh_dim_names))
        parallelize_module(module, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    model, unsplit = make(), make()
    state, _ = backend.prepare(af.tensor_parallel(parallelize, size=2)(af.train_step(sp_loss)),
                               af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1)))
    with torch.no_grad():
        fn_diff = float((state.model(batches[0]) - unsplit(batches[0])).abs().max())
    return {"sp_step": sp.step, "sp_diff": sp_diff, "sp_local": {k: list(v.to_local().shape) for k, v in
                                                                 sp.model.state_dict().items()},
            "fn_diff": fn_diff, "fn_meshes": [list(m[:2]) + [list(m[2])] for m in meshes],
            "fn_local": list(model[0].weight.to_local().shape)}


def tied(out: str) -> dict[str, Any]:
    """A tiny transformers Llama with tied embeddings and ``T.TiedLM`` (whose own plan leaves its
    tied embedding out) under ``tensor_parallel("auto", size=2) + clip(1.0)``, 6 SGD-momentum
    updates each; their gathered parameters (under every name) to ``OUT/tied-rank{r}.safetensors``,
    af.save_model of each to ``OUT/export-{kind}``; whether the tie was kept returned."""
    backend = af.backends.auto()
    tensors: dict[str, torch.Tensor] = {}
    result: dict[str, Any] = {}
    for kind in ("llama", "lm"):
        model = T.tied_model(kind)
        optimizer = torch.optim.SGD(model.parameters(), lr=T.TIED_LR, momentum=0.9)
        step = af.compose(af.shard_data(), af.tensor_parallel("auto", size=2), af.clip(T.CLIP))(
            af.train_step(T.tied_loss(kind)))
        state = af.run(step, af.TrainState.create(model, optimizer), T.tied_loader(), backend=backend,
                       progress=False)
        groups: dict[int, list[str]] = {}
        for name, p in state.model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(name)
            tensors[f"{kind}.{name}"] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        in_optimizer = [id(p) for g in state.optimizer.param_groups for p in g["params"]]
        tied_group = next(names for names in groups.values() if len(names) > 1)
        weight = dict(state.model.named_parameters())[tied_group[0]]
        result[kind] = {"step": state.step, "tied": tied_group,
                        "optimizer_holds_each_parameter_once": sorted(in_optimizer) == sorted(groups),
                        "tied_local": list(weight.to_local().shape), "tied_full": list(weight.shape)}
        af.save_model(state, Path(out) / f"export-{kind}", backend=backend)
    save_file(tensors, Path(out) / f"tied-rank{backend.rank}.safetensors")
    return result


def misuse() -> dict[str, Any]:
    """Each plan of ``T.MISUSED_PLANS`` on ``T.Blocks`` under tensor_parallel(size=2) through
    af.run (2 updates asked): what it raised on this rank, how many updates it applied, and
    whether any parameter changed."""
    backend = af.backends.auto()
    result: dict[str, Any] = {}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    loader = DataLoader(torch.utils.data.TensorDataset(x, x[:, :1]), batch_size=8)
    for variant, plan in T.MISUSED_PLANS.items():
        torch.manual_seed(0)
        model = T.Blocks()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        updates: list[int] = []
        step = af.compose(af.shard_data(), af.tensor_parallel(plan, size=2))(
            af.train_step(lambda m, b: torch.nn.functional.mse_loss(m(b[0]).mean(-1, keepdim=True), b[1])))
        try:
            af.run(step, af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1)), loader,
                   backend=backend, max_steps=2, progress=False,
                   hooks=[af.Hook(lambda s, b: updates.append(s.step), every_steps=1)])
            raised = None
        except Exception as e:  # noqa: BLE001  # what it raised is the result
            raised = f"{type(e).__name__}: {e}"
        after = T.full_state_dict(model)
        result[variant] = {"raised": raised, "updates": len(updates),
                           "changed": [k for k, v in before.items() if not torch.equal(after[k], v)]}

    def head_only(model: torch.nn.Module, mesh: Any) -> None:  # a plan function that splits one name of a tie
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        parallelize_module(model, mesh, {"head": ColwiseParallel()})

    model = T.TiedLM()
    try:
        backend.prepare(af.tensor_parallel(head_only, size=2)(af.train_step(T.tied_loss("lm"))),
                        af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1)))
        result["tied_function"] = {"raised": None}
    except Exception as e:  # noqa: BLE001  # what it raised is the result
        result["tied_function"] = {"raised": f"{type(e).__name__}: {e}"}
    return result
