"""Train a small CNN on scikit-learn's handwritten digits (real data, bundled: no download).

    python examples/digits.py                               # one process
    accelfn launch --nproc-per-node 2 examples/digits.py    # two processes, same script

Composes shard_data, replicate, accumulate and clip around a plain loss function, writes
TensorBoard logs to runs/digits/tb, and prints the held-out accuracy (>= 0.95).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af


class Net(torch.nn.Module):
    """Two 3x3 convolutions over the 8x8 image, then a linear classifier over 10 digits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.head = torch.nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, 1, 8, 8)
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # (batch, 32, 4, 4)
        return self.head(x.flatten(1))


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits, y), {"acc": (logits.argmax(-1) == y).float().mean()}


def datasets() -> tuple[TensorDataset, TensorDataset]:
    """The 1797 digits as (image (1, 8, 8) in [0, 1], label) pairs, split 80/20."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


def main(*, epochs: int = 12, batch_size: int = 16, logdir: str = "runs/digits/tb", progress: bool = True) -> float:
    """Trains and returns the held-out accuracy (a fraction in [0, 1])."""
    backend = af.backends.auto()
    torch.manual_seed(0)
    train, test = datasets()
    loader = DataLoader(train, batch_size=batch_size, shuffle=True)

    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    step = af.compose(
        af.shard_data(),
        af.replicate(),
        af.accumulate(2),
        af.clip(1.0),
    )(af.train_step(loss_fn))
    # the schedule counts optimizer updates of this launch (and of the one `accelfn plan` stands for)
    total = af.count_updates(step, loader, backend=backend, epochs=epochs).total
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
    state = af.TrainState.create(model, optimizer, scheduler=scheduler)

    trackers = [af.TensorBoard(logdir)]
    state = af.run(step, state, loader, backend=backend, epochs=epochs, trackers=trackers,
                   progress=progress, log_every=10)

    model = state.model.eval()
    with torch.inference_mode():
        x, y = test.tensors
        accuracy = (model(x.to(backend.device)).argmax(-1).cpu() == y).float().mean().item()
    backend.print(f"held-out accuracy: {accuracy:.4f} after {state.step} optimizer steps")
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--logdir", default="runs/digits/tb")
    args = parser.parse_args()
    main(epochs=args.epochs, batch_size=args.batch_size, logdir=args.logdir)
