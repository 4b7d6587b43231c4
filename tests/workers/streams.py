"""Pooled scenarios of tests/data/test_streams_ranks.py: streams under shard_data() + replicate() on
every rank of a real 2- or 3-process world (tests/helpers/streams.py's items and read logs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

import accelfn as af
from tests.helpers import streams as S

STREAMS = {"hf4": lambda log: S.hf_stream(4), "hf1": lambda log: S.hf_stream(1), "stream": lambda log: S.Stream(),
           "stateful": lambda log: S.StatefulStream(log=str(log))}


def _loader(kind: str, log: Path, workers: int) -> DataLoader:
    log.mkdir(parents=True, exist_ok=True)
    return DataLoader(STREAMS[kind](log), batch_size=S.BATCH, num_workers=workers, collate_fn=S.Collate(log))


def read_once(out: str, configs: list[tuple[str, int]]) -> dict[str, list[list[int]]]:
    """Epoch 0 of each ``(stream kind, workers)``, as ``run`` reads it on this rank
    (``backend.batches``: ranks kept in step); the reads are logged under ``out/KIND-WORKERS``.
    Returns this rank's batches' ids per ``KIND-WORKERS``."""
    backend = af.backends.auto()
    step = af.compose(af.shard_data(), af.replicate())(af.train_step(S.loss_fn([])))
    return {f"{kind}-{w}": [batch["id"].tolist() for batch, _ in
                            backend.batches(_loader(kind, Path(out) / f"{kind}-{w}", w), step, 0)]
            for kind, w in configs}


def resume(out: str, kind: str, workers: int, stop: int, parallel: str = "replicate") -> dict[str, Any]:
    """One epoch uninterrupted; then ``stop`` updates with a checkpoint there
    (``Checkpoints`` + ``max_steps``), and a fresh state resumed from it (``resume="auto"``),
    under ``replicate()`` or ``shard_params()`` (a sharded checkpoint).
    Reads are logged under ``out/whole``, ``out/part`` and ``out/rest``. Returns this rank's
    ids the step saw in each run and whether the parameters are bitwise those of the
    uninterrupted run."""
    backend = af.backends.auto()
    root = Path(out)

    def train(name: str, **options: Any) -> tuple[list[int], af.TrainState]:
        seen: list[int] = []
        shards = af.replicate() if parallel == "replicate" else af.shard_params()
        step = af.compose(af.shard_data(), shards)(af.train_step(S.loss_fn(seen)))
        state = af.run(step, S.fresh_state(), _loader(kind, root / name, workers), backend=backend, epochs=1,
                       progress=False, **options)
        return seen, state

    whole, uninterrupted = train("whole")
    part, _ = train("part", checkpoints=af.Checkpoints(root / "ckpt", every_steps=stop), max_steps=stop)
    rest, resumed = train("rest", checkpoints=af.Checkpoints(root / "ckpt", every_steps=1000), resume="auto")
    return {"whole": whole, "part": part, "rest": rest, "sharded": (root / "ckpt" / f"step_{stop:08d}" / "dcp").is_dir(),
            "same": all(torch.equal(a.full_tensor() if hasattr(a, "full_tensor") else a,
                                    b.full_tensor() if hasattr(b, "full_tensor") else b)
                        for a, b in zip(uninterrupted.model.parameters(), resumed.model.parameters()))}
