"""Programs shared by the ``tensor_parallel`` worker (tests/workers/tp_checks.py) and its
single-process references: an MLP on the regression data of ``programs``, and the byte LM of
examples/byte_lm.py (tiny) on random bytes, each with the hand-written loop it must equal."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from types import ModuleType
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import accelfn as af
from tests.helpers import launch as _launch
from tests.helpers import programs as P

UPDATES = 20
BATCH = 4
NUM_SAMPLES = 40  # 10 updates of BATCH per epoch: 2 epochs
EPOCHS = 2
CLIP = 1.0
CLIP_2D = 0.3  # windows of 16 samples have smaller gradients: a bound they pass
LR = 1e-2
MLP_PLAN = {"0": "colwise", "2": "rowwise"}
CONTEXT = 8
#: the update (from 1) whose gradient gets an inf on rank 1 only, in the fp16 and skip_nonfinite runs
POISONED_UPDATE = 5


def byte_lm() -> ModuleType:
    """examples/byte_lm.py as a module (registered, as attrs needs)."""
    name = "byte_lm_example"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _launch.ROOT / "examples" / "byte_lm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def make_model(kind: str) -> torch.nn.Module:
    """``"mlp"``: 4 -> 32 -> tanh -> 1; ``"lm"``: the byte LM, width 16, 2 blocks of 2 heads."""
    torch.manual_seed(0)
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    lm = byte_lm()
    return lm.ByteLM(lm.Config(context=CONTEXT, width=16, depth=2, heads=2))


def make_state(kind: str) -> af.TrainState:
    """AdamW with ``eps=1e-4``: the key part of a block's fused qkv bias has a gradient of exactly 0
    (softmax ignores a shift of every key by q.b), so in floating point it is rounding noise
    (~1e-9) that AdamW's default ``eps=1e-8`` would turn into full-size steps of random sign,
    different in any two summation orders; 1e-4 keeps those steps below 1e-7."""
    model = make_model(kind)
    return af.TrainState.create(model, torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-4))


def data(kind: str) -> TensorDataset:
    if kind == "mlp":
        return P.regression_data(NUM_SAMPLES)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (NUM_SAMPLES, CONTEXT + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def loss(kind: str) -> Any:
    return P.mse if kind == "mlp" else byte_lm().loss_fn


def loader(kind: str) -> DataLoader:
    return DataLoader(data(kind), batch_size=BATCH, shuffle=True)


def plan(kind: str) -> dict[str, str]:
    """The MLP's plan, or the byte LM example's own ``--tp`` plan (attention and MLP of every block)."""
    if kind == "mlp":
        return MLP_PLAN
    lm = byte_lm()
    return lm.tp_plan(lm.Config(heads=2), 2)


def item_counts(x: torch.Tensor) -> torch.Tensor:
    """``(batch, 4) -> (batch,)``: how many items each regression sample stands for (1, 2 or 3,
    from its first feature), so micro-batches hold ragged numbers of items."""
    return 1 + (x[:, 0].abs() * 2).floor().clamp(max=2)


def weighted_mse(model: torch.nn.Module, batch: Any) -> af.Loss:
    """The MLP's squared error summed over items (each sample counted ``item_counts`` times)."""
    x, y = batch
    counts = item_counts(x)
    return af.Loss(total=((model(x) - y).pow(2).squeeze(-1) * counts).sum(), count=counts.sum())


def hand_written(kind: str, *, data_world: int = 1, accumulate: int = 1, max_norm: float = CLIP,
                 weighted: bool = False, skip: int | None = None, autocast: torch.dtype | None = None,
                 losses: list[float] | None = None) -> tuple[torch.nn.Module, list[float]]:
    """One process, no accelfn: AdamW over windows of ``BATCH * data_world * accumulate``
    samples in the ``shard_data`` order of each epoch (the last window of an epoch what is
    left), clip_grad_norm_(max_norm) before every update.

    Args:
        weighted: the window's loss is ``weighted_mse``'s total over its item count (the MLP).
        skip: the index (from 0, over both epochs) of an update not applied.
        autocast: the forward under ``torch.autocast("cpu", dtype=autocast)``.
        losses: gets each window's loss appended.

    Returns:
        The trained model and the gradient norm before clipping of every update.
    """
    state = make_state(kind)
    model, opt = state.model, state.optimizer
    dataset = data(kind)
    x, y = dataset.tensors
    norms = []
    for epoch in range(EPOCHS):
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=P.SHARD_SEED)
        sampler.set_epoch(epoch)
        order = list(sampler)
        size = BATCH * data_world * accumulate
        for start in range(0, len(order), size):
            batch = (x[order[start:start + size]], y[order[start:start + size]])
            with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
                if weighted:
                    out = weighted_mse(model, batch)
                    value = out.total / out.count
                else:
                    value = loss(kind)(model, batch)
            value.backward()
            if losses is not None:
                losses.append(float(value.detach()))
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
            if len(norms) - 1 != skip:
                opt.step()
            opt.zero_grad()
    return model, norms


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer gathered whole, on the CPU (tied weights under each name)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
            for k, v in model.state_dict(keep_vars=False).items()}


# -- tied weights under "auto" (tp_checks.tied) --------------------------------------------

TIED_UPDATES = 6  # 48 sequences in batches of 8, one epoch
TIED_LR = 0.5


class TiedLM(torch.nn.Module):
    """A small LM whose output layer is its embedding (tied), with a transformers-style own plan
    that names the output layer and the MLPs but not the embedding ("auto" must split it alike)."""

    _tp_plan = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise", "head": "colwise_gather_output"}

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({"up": torch.nn.Linear(16, 32),
                                                               "down": torch.nn.Linear(32, 16)}) for _ in range(2))
        self.head = torch.nn.Linear(16, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = h + block["down"](torch.tanh(block["up"](h)))
        return self.head(h)


def tied_model(kind: str) -> torch.nn.Module:
    """``"llama"``: a tiny transformers Llama with tie_word_embeddings=True; ``"lm"``: TiedLM."""
    torch.manual_seed(0)
    if kind == "lm":
        return TiedLM()
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def tied_loader() -> DataLoader:
    tokens = torch.randint(0, 64, (TIED_UPDATES * 8, 16), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(tokens), batch_size=8, shuffle=False)


def tied_loss(kind: str) -> Any:
    if kind == "llama":
        return lambda model, batch: model(input_ids=batch[0], labels=batch[0]).loss
    return lambda model, batch: torch.nn.functional.cross_entropy(model(batch[0][:, :-1]).flatten(0, 1),
                                                                   batch[0][:, 1:].flatten())


def tied_hand_written(kind: str) -> torch.nn.Module:
    """One process, no accelfn: SGD with momentum over the batches in order, clip_grad_norm_(1.0)."""
    model = tied_model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=TIED_LR, momentum=0.9)
    for batch in tied_loader():
        tied_loss(kind)(model, batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return model


# -- plans users get wrong (tp_checks.misuse; the e21 field case) -----------------------------


class Blocks(torch.nn.Module):
    """Two residual MLP blocks, a LayerNorm and a head of two scores."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({"up": torch.nn.Linear(16, 64),
                                                               "down": torch.nn.Linear(64, 16)}) for _ in range(2))
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block["down"](torch.tanh(block["up"](x)))
        return self.head(self.norm(x))


MISUSED_PLANS = {
    "swapped": {"blocks.*.up": "rowwise", "blocks.*.down": "colwise"},
    "head": {"blocks.*.up": "colwise", "blocks.*.down": "rowwise", "head": "colwise"},
    "unsplit_into_colwise": {"blocks.*.up": "colwise", "blocks.*.down": "colwise"},
}
