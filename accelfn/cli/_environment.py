"""What ``accelfn env`` reports of this installation: packages, devices, distributed backends."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import torch
import torch.distributed as dist


def availability() -> list[tuple[str, str]]:
    """Each distributed backend and device type, and whether this installation can use it."""
    def yes(flag: bool) -> str:
        return "yes" if flag else "no"

    distributed = dist.is_available()
    rows = [
        ("torch.distributed", yes(distributed)),
        ("gloo (CPU processes)", yes(distributed and dist.is_gloo_available())),
        ("nccl (CUDA processes)", yes(distributed and dist.is_nccl_available())),
        ("cuda", f"yes, {torch.cuda.device_count()} device(s)" if torch.cuda.is_available() else "no"),
    ]
    if importlib.util.find_spec("torch_xla") is None:
        rows.append(("torch_xla", "not installed"))
    else:
        rows.append(("torch_xla", f"installed, {importlib.metadata.version('torch_xla')}"))
    return rows


_PACKAGES = ("numpy", "attrs", "cattrs", "toolz", "safetensors", "tensorboardX", "orjson", "PyYAML", "tqdm")


def package_versions() -> str:
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return ", ".join(f"{name} {version(name)}" for name in _PACKAGES)


def devices() -> list[str]:
    lines = [f"cpu: {os.cpu_count()} logical cores, {torch.get_num_threads()} torch threads"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i}: {props.name}, {props.total_memory / 2**30:.1f} GiB, "
                         f"compute capability {props.major}.{props.minor}")
    return lines + _xla_devices()


def _xla_devices() -> list[str]:
    """The XLA devices of this process's PJRT client, where ``PJRT_DEVICE`` asks for one and
    torch_xla is installed (importing it starts the client); else why there are none."""
    device = os.environ.get("PJRT_DEVICE")
    if importlib.util.find_spec("torch_xla") is None:
        return [] if not device else [f"xla: PJRT_DEVICE={device} is set, but torch_xla is not installed"]
    if not device:
        return ["xla: torch_xla is installed; set PJRT_DEVICE (TPU, CUDA or CPU) to use it (af.backends.auto() "
                "then picks XLA)"]
    import torch_xla
    import torch_xla.runtime as xr

    kind = xr.device_type()
    return [f"{d}: {kind} (PJRT_DEVICE={device})" for d in torch_xla.devices()]
