"""Train a small GAN on scikit-learn's handwritten digits: two models, two optimizers.

    python examples/gan_digits.py                               # one process
    accelfn launch --nproc-per-node 2 examples/gan_digits.py    # two processes, same script

A generator and a discriminator are two TrainStates, each with its own program (its loss
function and transforms) prepared by the same backend; a short loop calls the two step
functions on every batch. Each state has its own ``af.Checkpoints``; a run resumes from
the latest step both hold, so an interrupted run continues bitwise as if never stopped.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import accelfn as af

LATENT = 16  # size of the generator's noise input


def generator() -> torch.nn.Module:
    """Noise (batch, LATENT) -> image (batch, 64) in [-1, 1]."""
    return torch.nn.Sequential(torch.nn.Linear(LATENT, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64),
                               torch.nn.Tanh())


def discriminator() -> torch.nn.Module:
    """Image (batch, 64) -> logit (batch,) that the image is real."""
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LeakyReLU(0.2), torch.nn.Linear(128, 1),
                               torch.nn.Flatten(0))


def dataset() -> TensorDataset:
    """The 1797 digits as flat images (64,) scaled to [-1, 1]."""
    images = torch.tensor(load_digits().images, dtype=torch.float32).flatten(1)
    return TensorDataset(images / 8.0 - 1.0)


def programs(gen: torch.nn.Module, disc: torch.nn.Module) -> tuple[af.Step, af.Step]:
    """The discriminator's and the generator's programs (non-saturating GAN losses).

    Each loss function receives its own model (wrapped in DDP under ``replicate``) and
    reads the other model unwrapped: the discriminator sees generated images computed
    without gradients, and the generator's loss runs the discriminator with its parameters
    detached, so a generator update leaves no gradient on the discriminator.
    """

    def d_loss(d: torch.nn.Module, batch: tuple[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        (real,) = batch
        with torch.no_grad():
            fake = gen(torch.randn(real.shape[0], LATENT, device=real.device))
        logits = d(torch.cat([real, fake]))  # one forward: DDP reduces once per backward
        labels = torch.cat([torch.ones(real.shape[0]), torch.zeros(real.shape[0])]).to(logits.device)
        accuracy = ((logits > 0).float() == labels).float().mean()
        return F.binary_cross_entropy_with_logits(logits, labels), {"d_acc": accuracy}

    def g_loss(g: torch.nn.Module, batch: tuple[torch.Tensor]) -> torch.Tensor:
        (real,) = batch
        fake = g(torch.randn(real.shape[0], LATENT, device=real.device))
        frozen = {name: p.detach() for name, p in disc.named_parameters()}
        logits = torch.func.functional_call(disc, frozen, (fake,))
        return F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))

    transforms = af.compose(af.shard_data(), af.replicate())
    return transforms(af.train_step(d_loss)), transforms(af.train_step(g_loss))


def common_step(backend: af.backends.Backend, *checkpoints: af.Checkpoints) -> int | None:
    """The highest step every one of ``checkpoints`` holds (rank 0's view, on every rank)."""
    steps = set.intersection(*(set(c.steps()) for c in checkpoints))
    step = int(backend.broadcast(torch.tensor([max(steps, default=-1)])).item())
    return None if step < 0 else step


def main(*, epochs: int = 30, max_steps: int | None = None, batch_size: int = 32, directory: str = "runs/gan",
         every_steps: int = 100, resume: bool = False, progress: bool = True) -> tuple[af.TrainState, af.TrainState]:
    """Trains the pair; returns the (discriminator, generator) states."""
    backend = af.backends.auto()
    torch.manual_seed(0)  # the same initial models on every rank (DDP also broadcasts rank 0's)
    gen, disc = generator(), discriminator()
    d_state = af.TrainState.create(disc, torch.optim.Adam(disc.parameters(), lr=2e-4, betas=(0.5, 0.999)))
    g_state = af.TrainState.create(gen, torch.optim.Adam(gen.parameters(), lr=2e-4, betas=(0.5, 0.999)))
    torch.manual_seed(1 + backend.rank)  # each rank draws its own noise
    d_program, g_program = programs(gen, disc)
    d_state, d_step = backend.prepare(d_program, d_state)
    g_state, g_step = backend.prepare(g_program, g_state)

    d_ckpts = af.Checkpoints(Path(directory) / "discriminator", every_steps=every_steps, keep=2)
    g_ckpts = af.Checkpoints(Path(directory) / "generator", every_steps=every_steps, keep=2)
    if resume and (step := common_step(backend, d_ckpts, g_ckpts)) is not None:
        d_state = af.load(d_ckpts.path_for(step), into=d_state, backend=backend)
        g_state = af.load(g_ckpts.path_for(step), into=g_state, backend=backend)
        backend.print(f"resumed both models from step {step} (epoch {d_state.epoch})")

    loader = DataLoader(dataset(), batch_size=batch_size, shuffle=True)
    for epoch in range(d_state.epoch, epochs):
        for batch, last in backend.batches(loader, d_program, epoch, start=d_state.epoch_micro_step):
            d_state, d_metrics = d_step(d_state, batch, flush=last)
            g_state, g_metrics = g_step(g_state, batch, flush=last)
            if last:  # the epoch is over: a checkpoint written now starts the next one
                d_state = d_state.replace(epoch=epoch + 1, epoch_micro_step=0)
                g_state = g_state.replace(epoch=epoch + 1, epoch_micro_step=0)
            if d_metrics and d_state.step % every_steps == 0:  # after an update; a resume needs both
                g_ckpts.save(g_state, backend)
                d_ckpts.save(d_state, backend)
            if max_steps is not None and d_state.step >= max_steps:
                return d_state, g_state
        if progress:
            backend.print(f"epoch {epoch}: d_loss {float(d_metrics['loss']):.3f} d_acc {float(d_metrics['d_acc']):.2f} "
                          f"g_loss {float(g_metrics['loss']):.3f}")
    return d_state, g_state


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--dir", default="runs/gan")
    parser.add_argument("--every-steps", type=int, default=100)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--out", default=None, help="write both final states here (af.save)")
    args = parser.parse_args()
    d, g = main(epochs=args.epochs, max_steps=args.max_steps, directory=args.dir, every_steps=args.every_steps,
                resume=args.resume)
    if args.out:
        af.save(d, Path(args.out) / "discriminator")
        af.save(g, Path(args.out) / "generator")
