"""Worker for tests/distributed/test_exit.py: a rank that leaves by an exit, not an exception.

Usage: accelfn launch --nproc-per-node 2 exits.py MODE

``hook``: rank 0's hook calls ``sys.exit("loss diverged")`` after update 3 (rank 1 goes on
into its next collective). ``evaluate``: rank 1's ``fn`` calls ``sys.exit(0)`` inside
``af.evaluate`` (rank 0 goes on into the gather of the outputs). ``together``: every rank's
hook calls ``sys.exit(3)`` after update 2 (the ranks leave together).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import accelfn as af


def main() -> None:
    mode = sys.argv[1]
    backend = af.backends.auto()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    state = af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(40)]
    step = af.compose(af.shard_data(), af.replicate())(af.train_step(lambda m, b: F.mse_loss(m(b[0]), b[1])))

    def guard(state: af.TrainState, backend: af.backends.Backend) -> None:
        if mode == "hook" and backend.is_main_process and state.step == 3:
            sys.exit("loss diverged")
        if mode == "together" and state.step == 2:
            sys.exit(3)

    epochs = 1 if mode == "evaluate" else 50
    state = af.run(step, state, data, backend=backend, epochs=epochs, progress=False,
                   hooks=[af.Hook(guard, every_steps=1)])

    def outputs(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        if backend.rank == 1:
            sys.exit(0)
        return model(batch)

    af.evaluate(outputs, state, torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2), backend=backend)
    backend.print("evaluate returned")


if __name__ == "__main__":
    main()
