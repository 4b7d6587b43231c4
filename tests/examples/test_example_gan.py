"""Two models, two optimizers: the GAN of examples/gan_digits.py against a hand-written loop.

On two processes, a resumed run equals an uninterrupted one bit for bit (tests/workers/gan_resume.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import accelfn as af
from tests.helpers import launch as _launch
from tests.helpers.pool import Pools

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gan_digits.py"


def load_example():
    spec = importlib.util.spec_from_file_location("gan_digits_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_prepared_programs_equal_a_hand_written_two_optimizer_loop() -> None:
    """Alternating the discriminator's and the generator's step functions over 6 batches gives
    both models the parameters of the plain PyTorch GAN loop (1e-6), and a generator update
    leaves no gradient on the discriminator."""
    gan = load_example()
    batches = [(x,) for x in gan.dataset().tensors[0][:48].split(8)]

    def models() -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
        torch.manual_seed(0)
        gen, disc = gan.generator(), gan.discriminator()
        return (gen, disc, torch.optim.Adam(gen.parameters(), lr=2e-4, betas=(0.5, 0.999)),
                torch.optim.Adam(disc.parameters(), lr=2e-4, betas=(0.5, 0.999)))

    gen, disc, g_opt, d_opt = models()
    backend = af.backends.CPU(af.backends.LaunchEnv())
    d_program, g_program = gan.programs(gen, disc)
    d_state, d_step = backend.prepare(d_program, af.TrainState.create(disc, d_opt))
    g_state, g_step = backend.prepare(g_program, af.TrainState.create(gen, g_opt))
    torch.manual_seed(7)
    for batch in batches:
        d_state, _ = d_step(d_state, batch)
        g_state, _ = g_step(g_state, batch)
        assert all(p.grad is None for p in disc.parameters())

    ref_gen, ref_disc, ref_g_opt, ref_d_opt = models()
    torch.manual_seed(7)
    for (real,) in batches:
        with torch.no_grad():
            fake = ref_gen(torch.randn(8, gan.LATENT))
        logits = ref_disc(torch.cat([real, fake]))
        F.binary_cross_entropy_with_logits(logits, torch.cat([torch.ones(8), torch.zeros(8)])).backward()
        ref_d_opt.step()
        ref_d_opt.zero_grad()
        logits = ref_disc(ref_gen(torch.randn(8, gan.LATENT)))
        F.binary_cross_entropy_with_logits(logits, torch.ones(8)).backward()
        ref_g_opt.step()
        ref_g_opt.zero_grad()
        ref_d_opt.zero_grad()  # the generator's backward reached the discriminator's parameters

    assert (d_state.step, g_state.step) == (6, 6)
    for got, expected in zip([*gen.parameters(), *disc.parameters()], [*ref_gen.parameters(), *ref_disc.parameters()]):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


@pytest.mark.multiprocess
def test_gan_resumed_on_two_processes_equals_the_uninterrupted_run_bitwise(pool: Pools, tmp_path: Path) -> None:
    """On 2 processes, training to step 20 and resuming in fresh states to step 34 (past the end
    of epoch 0) gives both models, optimizers, counters and RNG states bit for bit as 34 steps
    in one go."""
    pool.launch("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60", script="gan_resume.py",
                script_args=("--out", tmp_path), cwd=tmp_path)
    ranks = _launch.read_ranks(tmp_path, 2)
    assert ranks[0]["printed"] == "resumed both models from step 20 (epoch 0)\n"  # the main process prints
    assert ranks[1]["printed"] == ""
    for rank in ranks:
        assert rank["steps"] == [34, 34, 34, 34]  # resumed discriminator, generator; uninterrupted ones
        assert rank["epochs"] == [1, 1, 1, 1]
        assert rank["identical"] == [True, True]
