"""Worker for tests/examples/test_example_gan.py: the GAN example interrupted and resumed on 2 ranks.

Usage: accelfn launch --nproc-per-node 2 gan_resume.py --out DIR
Trains examples/gan_digits.py to step 20 (checkpoints of both models), resumes it in fresh
states to step 34 (past the end of epoch 0), trains 34 steps in one go, and writes
DIR/rank{r}.json: what the resumed run printed, the final counters, and whether each
model's resumed state equals the uninterrupted one bit for bit.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

import accelfn as af

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gan_digits.py"


def identical(x: Any, y: Any) -> bool:
    """``x`` and ``y`` are the same tree with bitwise equal tensors (and dtypes) and equal values."""
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, np.ndarray):
        return isinstance(y, np.ndarray) and np.array_equal(x, y)
    if attrs.has(type(x)):
        return type(x) is type(y) and identical(attrs.asdict(x, recurse=False), attrs.asdict(y, recurse=False))
    if isinstance(x, Mapping):
        return isinstance(y, Mapping) and x.keys() == y.keys() and all(identical(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return isinstance(y, (list, tuple)) and len(x) == len(y) and all(identical(p, q) for p, q in zip(x, y))
    return bool(x == y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("gan_digits", EXAMPLE)
    example = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(example)  # type: ignore[union-attr]
    options: dict[str, Any] = {"epochs": 3, "every_steps": 20, "progress": False}

    example.main(max_steps=20, directory=str(args.out / "interrupted"), **options)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        resumed = example.main(max_steps=34, directory=str(args.out / "interrupted"), resume=True, **options)
    whole = example.main(max_steps=34, directory=str(args.out / "whole"), **options)

    fields = ("model", "optimizer", "counters", "transforms_state", "rng")
    results = {
        "printed": printed.getvalue(),
        "steps": [s.step for s in (*resumed, *whole)],
        "epochs": [s.epoch for s in (*resumed, *whole)],
        "identical": [all(identical(getattr(af.snapshot(a), f), getattr(af.snapshot(b), f)) for f in fields)
                      for a, b in zip(resumed, whole)],
    }
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    (args.out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
