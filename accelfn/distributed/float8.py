"""What ``with_precision("fp8")`` does to a model: torchao's float8 training, as two model phases.

``Convert`` swaps each ``nn.Linear`` that suits float8 for torchao's ``Float8Linear``
(``torchao.float8.convert_to_float8_training`` with the policy's recipe): its matmuls run in
float8 e4m3 (``torch._scaled_mm``) with dynamic scales, its weight stays the same fp32
``Parameter`` (the master weight the optimizer updates and checkpoints store, under the same
``state_dict`` name). A layer is kept in high precision when its name is excluded (or it is
under an excluded module), when it is the model's output head (``get_output_embeddings()``),
or when a dimension is not a multiple of 16 (torchao's rule, ``_auto_filter_for_recipe``:
``torch._scaled_mm`` needs both dimensions of each operand aligned to 16). It runs before
``shard_params`` (torchao converts before FSDP2 wraps, as torchtitan does).

``Scales`` acts under ``shard_params`` with float8 all-gathers (torchao's
``enable_fsdp_float8_all_gather``: each weight shard is cast to float8 before FSDP2's
all-gather, a quarter of fp32's bytes). The scale of every weight is computed in one
all-reduce (``precompute_float8_dynamic_scale_for_fsdp``) before a forward whenever a weight
changed since the last one (an update, a load, ``load_model``): its tensor version counters
tell, so a resumed run computes its scales from the loaded weights exactly as the
uninterrupted run did from the same weights.

References:
    torchao ``torchao/float8/README.md`` (recipes, FSDP2 float8 all-gathers); torchtitan
    ``components/quantization/float8.py`` and ``docs/float8.md`` (the same steps in a trainer).
"""

from __future__ import annotations

import dataclasses
import functools
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from accelfn.distributed import fsdp
from accelfn.distributed.ops import plain
from accelfn.distributed.phases import ModelPhase
from accelfn.transforms import Invariant, Pipeline, ShardParams, TensorParallel
from accelfn.transforms.precision import Float8

if TYPE_CHECKING:
    from accelfn.distributed.phases import Preparation

#: torchao's alignment rule: both dimensions of a converted weight are multiples of this
ALIGNMENT = 16
#: the attribute of a model whose float8 scales ``Scales`` keeps current
_SCALES = "_accelfn_float8_scales"
#: the transforms whose model phases do not compose with float8 layers yet, and why
_REFUSED: tuple[tuple[type, str], ...] = (
    (TensorParallel, "tensor_parallel needs torchao's float8 parallel styles (Float8ColwiseParallel, ...), "
                     "which accelfn's plans do not use yet"),
    (Pipeline, "pipeline traces the model into stages, and torchao's float8 tensors are not traced yet"),
    (Invariant, "invariant's canonical sums are defined for fp32/bf16 gradients, not yet for float8 matmuls"),
)
INSTALL = "pip install 'accelfn[fp8]' (torchao)"


def torchao_float8() -> ModuleType:
    """``torchao.float8``.

    Raises:
        ModuleNotFoundError: torchao is not installed (the message says how to install it).
    """
    try:
        import torchao.float8
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"with_precision('fp8') trains through torchao's float8 layers, and torchao "
                                  f"is not installed: {INSTALL}") from e
    return torchao.float8


@functools.cache
def _cpu_scaled_mm() -> str | None:
    """Why this torch cannot multiply float8 e4m3 matrices on the CPU, or None (it can)."""
    try:
        a = torch.ones(16, 16).to(torch.float8_e4m3fn)
        one = torch.ones((), dtype=torch.float32)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        return f"torch {torch.__version__} has no float8 matmul on the CPU ({type(e).__name__}: {e})"
    return None


def why_unsupported(device: torch.device) -> str | None:
    """Why float8 training cannot run on ``device`` here, with the fix, or None (it can).

    Float8 matmuls (``torch._scaled_mm``) need a CUDA GPU of compute capability 8.9 or newer
    (H100, L4, RTX 4090: torchao's and torchtitan's requirement), or a torch whose CPU kernels
    have them (torch 2.6 and later).
    """
    try:
        torchao_float8()
    except ModuleNotFoundError as e:
        return str(e)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return (f"with_precision('fp8') needs float8 matmuls, which need a GPU of compute capability 8.9 or newer "
                    f"(H100, L4, RTX 4090); {torch.cuda.get_device_name(device)} is {major}.{minor}. "
                    "Use with_precision('bf16') on this GPU")
        return None
    if device.type == "cpu":
        reason = _cpu_scaled_mm()
        return None if reason is None else f"with_precision('fp8'): {reason}; use with_precision('bf16') or a newer torch"
    return f"with_precision('fp8') runs on CUDA GPUs and the CPU, not on {device.type} devices; use with_precision('bf16')"


def is_float8(module: torch.nn.Module) -> bool:
    """Whether ``module`` is torchao's ``Float8Linear``."""
    return type(module).__name__ == "Float8Linear" and type(module).__module__.startswith("torchao.")


def is_converted(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds torchao ``Float8Linear`` layers."""
    return any(is_float8(m) for m in model.modules())


def _head(model: torch.nn.Module) -> str | None:
    """The name of the model's output head (``get_output_embeddings()``, Hugging Face's), or None."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if not isinstance(head, torch.nn.Module):
        return None
    return next((name for name, m in model.named_modules() if m is head), None)


def kept(model: torch.nn.Module, float8: Float8) -> dict[str, str]:
    """Each ``nn.Linear`` of ``model`` kept in high precision, by name, with the reason.

    A layer is kept when it is, or is under, a module named in ``float8.exclude``; when it is
    the output head (``get_output_embeddings()``); or when its weight's dimensions are not both
    multiples of ``ALIGNMENT`` (torchao's rule).
    """
    head = _head(model)
    out: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        excluded = next((e for e in float8.exclude if name == e or name.startswith(e + ".")), None)
        rows, cols = module.weight.shape
        if excluded is not None:
            out[name] = f"excluded ({excluded!r})"
        elif name == head:
            out[name] = "the output head (get_output_embeddings())"
        elif rows % ALIGNMENT or cols % ALIGNMENT:
            out[name] = f"weight {rows}x{cols}: both dimensions must be multiples of {ALIGNMENT}"
    return out


def convertible(model: torch.nn.Module, float8: Float8) -> list[str]:
    """The names of the ``nn.Linear`` layers of ``model`` that ``Convert`` swaps, in order."""
    skip = kept(model, float8)
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in skip]


def gathers_in_float8(prep: Preparation) -> bool:
    """Whether ``prep``'s program all-gathers weights in float8: fp8 with ``float8_all_gather``
    under a ``shard_params`` that shards (over more than one rank)."""
    float8 = prep.policy.float8
    return (float8 is not None and float8.all_gather and prep.step.find(ShardParams) is not None
            and prep.mesh.shard > 1)


class Convert(ModelPhase):
    """``with_precision("fp8")``'s conversion: the model's suitable ``nn.Linear`` layers to torchao's
    ``Float8Linear``, before ``shard_params`` shards them."""

    name: ClassVar[str] = "fp8"

    def __init__(self, float8: Float8 | None, converted: bool):
        self.float8 = float8
        self.converted = converted

    @classmethod
    def of(cls, prep: Preparation) -> Convert | None:
        float8, converted = prep.policy.float8, is_converted(prep.state.model)
        return cls(float8, converted) if float8 is not None or converted else None

    def unsupported(self, prep: Preparation) -> str | None:
        """The backend's refusal, or why this device (or install) has no float8 training."""
        return super().unsupported(prep) or (why_unsupported(prep.hardware.device) if self.float8 else None)

    def check(self, prep: Preparation) -> None:
        """Raises before anything changes.

        Raises:
            ValueError: a converted model under another policy; an excluded name the model does
                not have; no layer left to convert.
            NotImplementedError: fp8 with a transform it does not compose with yet.
        """
        if self.float8 is None:
            raise ValueError(f"this state's model was converted to float8 training (with_precision('fp8')), so its "
                             f"step must use with_precision('fp8') too, not {prep.policy.name!r}; build the state "
                             "again (a new model and optimizer) to train it in another precision")
        for kind, why in _REFUSED:
            if prep.step.find(kind) is not None:
                raise NotImplementedError(f"with_precision('fp8') with {kind.__name__.lower()}: {why}; use "
                                          "with_precision('bf16') with it")
        if self.converted:
            return
        model = prep.state.model
        names = {n for n, _ in model.named_modules()}
        unknown = [e for e in self.float8.exclude if e not in names]
        if unknown:
            raise ValueError(f"with_precision('fp8', exclude=...): the model has no module named "
                             f"{', '.join(map(repr, unknown))}; names are named_modules()'s, e.g. "
                             f"{', '.join(repr(n) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))}")
        if not convertible(model, self.float8):
            why = "; ".join(f"{n or 'the model'}: {r}" for n, r in kept(model, self.float8).items()) or "it has no nn.Linear"
            raise ValueError(f"with_precision('fp8'): no layer of the model suits float8 ({why}); use "
                             "with_precision('bf16'), or give the layers dimensions that are multiples of "
                             f"{ALIGNMENT}")

    def apply(self, prep: Preparation) -> None:
        if self.converted:
            return
        assert self.float8 is not None
        ao = torchao_float8()
        model, optimizer = prep.state.model, prep.state.optimizer
        config = ao.Float8LinearConfig.from_recipe_name(self.float8.recipe)
        if gathers_in_float8(prep):
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        chosen = set(convertible(model, self.float8))
        names = {id(p): name for name, p in model.named_parameters()}
        ao.convert_to_float8_training(model, config=config, module_filter_fn=lambda _, name: name in chosen)
        # float8 all-gathers wrap each converted weight in a new Parameter: the optimizer follows by name
        params = dict(model.named_parameters())
        fsdp.rebind(optimizer, {id_: params[name] for id_, name in names.items()})


class Scales(ModelPhase):
    """Under float8 all-gathers, every weight's float8 scale computed in one all-reduce
    (torchao's ``precompute_float8_dynamic_scale_for_fsdp``) before a forward whenever a
    weight changed since the scales were last computed; after ``shard_params`` and
    ``materialize``, when the weights are sharded and real."""

    name: ClassVar[str] = "fp8 scales"

    @classmethod
    def of(cls, prep: Preparation) -> Scales | None:
        return cls() if gathers_in_float8(prep) else None

    def unsupported(self, prep: Preparation) -> str | None:
        return None  # Convert's refusal covers it

    def apply(self, prep: Preparation) -> None:
        model = prep.state.model
        if getattr(model, _SCALES, None) is None:
            keeper = _ScaleKeeper(model)
            object.__setattr__(model, _SCALES, keeper)
            # ahead of FSDP2's pre-forward all-gather; not traced by torch.compile (Python state)
            model.register_forward_pre_hook(torch.compiler.disable(keeper.before_forward), prepend=True)


class _ScaleKeeper:
    """Recomputes a sharded float8 model's weight scales when a weight's version changed."""

    def __init__(self, model: torch.nn.Module):
        self._model = model
        self._weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and is_float8(m)]
        self._seen: list[tuple[int, ...]] | None = None

    def _versions(self) -> list[tuple[int, ...]]:
        return [_versions(w) for w in self._weights]

    def before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if torch._C._current_graph_task_id() != -1:  # a forward recomputed inside the backward
            return
        versions = self._versions()
        if versions != self._seen:
            torchao_float8().precompute_float8_dynamic_scale_for_fsdp(self._model)
            self._seen = self._versions()


def _versions(weight: torch.Tensor) -> tuple[int, ...]:
    """The version counters of a sharded float8 weight: the DTensor's (an optimizer's update, a
    ``load_state_dict``), its local torchao wrapper's (a ``copy_`` into ``to_local()``) and its
    plain data's (a write through ``distributed.plain``); each counts its own in-place changes."""
    local = weight._local_tensor if hasattr(weight, "_local_tensor") else weight
    return (weight._version, local._version, plain(local)._version)
