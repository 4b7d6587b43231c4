"""Trains a ~100 MB state with a checkpoint after every update, written in the background.

Every parameter starts at 0 and grows by exactly 1 per optimizer update (SGD, lr 1, loss
``-sum(parameters)``), so a checkpoint of step k holds k in every element: a checkpoint
mixing two steps, or a torn file, shows. Runs until killed (or SIGTERM'd).

Usage: ``python async_saves.py DIRECTORY`` trains into DIRECTORY. ``python async_saves.py
--fork`` imports torch once and then serves lines on stdin: ``run DIRECTORY`` forks a
trainer (its stderr in DIRECTORY.stderr) and answers ``pid N``; ``wait N`` answers
``status S`` (the exit status, -signal when killed); so a test that kills many trainers
pays for one interpreter start.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

import accelfn as af

LAYERS, WIDTH = 25, 1024  # 25 x 1024 x 1024 float32 = 100 MiB of parameters


def build() -> af.TrainState:
    """The state, every parameter at 0."""
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(WIDTH, WIDTH)) for _ in range(LAYERS)])
    return af.TrainState.create(model, torch.optim.SGD(model.parameters(), lr=1.0))


def loss_fn(model: torch.nn.Module, batch: object) -> torch.Tensor:
    """Minus the sum of all parameters: the gradient of every element is -1."""
    return -sum(p.sum() for p in model.parameters())


def train(directory: str) -> None:
    """Trains until killed, checkpointing after every update in the background."""
    torch.set_num_threads(1)
    checkpoints = af.Checkpoints(directory, every_steps=1, keep=2, asynchronous=True)
    af.run(af.train_step(loss_fn), build(), [0] * 1000, backend=af.backends.CPU(), epochs=None,
           max_steps=10**6, checkpoints=checkpoints, progress=False)


def serve() -> None:
    """Forks trainers on request (see the module's docstring)."""
    for line in sys.stdin:
        command, argument = line.split()
        if command == "run":
            pid = os.fork()
            if pid == 0:
                with open(argument + ".stderr", "w") as err:
                    os.dup2(err.fileno(), 2)
                code = 0
                try:
                    train(argument)
                except SystemExit as e:
                    code = int(e.code or 0)
                except BaseException:
                    traceback.print_exc()
                    code = 1
                finally:
                    sys.stderr.flush()
                    os._exit(code)
            print(f"pid {pid}", flush=True)
        elif command == "wait":
            _, status = os.waitpid(int(argument), 0)
            print(f"status {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    serve() if sys.argv[1] == "--fork" else train(sys.argv[1])
