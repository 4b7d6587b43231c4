"""The LoRA example fine-tunes a Llama on 2 sharded processes from a stream, resumes bitwise
mid-epoch, and its exports reload with peft and transformers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import launch as _launch
from tests.helpers.pool import Pools

pytest.importorskip("peft", reason="the LoRA example needs peft (pip install 'accelfn[peft]'; .ci/run installs it)")
pytest.importorskip("datasets", reason="the LoRA example streams with datasets (pip install 'accelfn[streaming]')")

EXAMPLE = _launch.ROOT / "examples" / "lora_llama.py"


@pytest.mark.multiprocess
def test_lora_example_resumes_bitwise_and_its_exports_reload(tmp_path: Path, pool: Pools) -> None:
    """``accelfn launch --nproc-per-node 2 examples/lora_llama.py`` (shard_params, bf16, a HF
    stream of 4 local files): the run stopped at step 2 of 4 (mid-epoch of 8) and resumed ends
    bitwise equal to the uninterrupted one; the resumed run's checkpoint links the first one's
    frozen base instead of writing it again; rank 0 reloads the adapter export, which holds the
    trained adapter exactly, and the merged export, whose logits equal the adapter's (<= 1e-5)."""
    result = pool.launch("--backend", "cpu", "--nproc-per-node", "2", "--timeout-s", "60", script=EXAMPLE,
                         script_args=("--run-dir", tmp_path / "run"), cwd=tmp_path)
    out = result.stdout
    assert "resumed at step 2 of 4 (mid-epoch of 8): bitwise equal to the uninterrupted run: True" in out, out[-3000:]
    assert "adapter export holds the trained adapter: True" in out, out[-3000:]
    assert "the base written once (later dcp-frozen/ files are hard links to the first's): True" in out, out[-3000:]
    gap = re.search(r"logits differ by ([0-9.e+-]+)", out)
    assert gap is not None and float(gap[1]) <= 1e-5, out[-3000:]
    assert out.count("\nOK\n") + out.startswith("OK\n") == 1
    adapter, merged = tmp_path / "run" / "export" / "adapter", tmp_path / "run" / "export" / "merged"
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert sorted(p.name for p in merged.iterdir()) == ["config.json", "model.safetensors"]
