"""`akv.presets.from_hf_config`: a model's own Hugging Face config.json describes its cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from akv import ConfigError
from akv.presets import PRESETS, from_hf_config, preset

CONFIGS = Path(__file__).parent / "hf_configs"  # the six presets' public configs (trimmed, no downloads)


def config(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((CONFIGS / f"{name}.json").read_text())
    return data


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_equal_their_public_configs(name: str) -> None:
    """Each preset equals what from_hf_config derives from its model's public config.json (path or dict)."""
    assert from_hf_config(CONFIGS / f"{name}.json") == preset(name)
    assert from_hf_config(config(name), block_size=32, layout="head-major") == preset(
        name, block_size=32, layout="head-major"
    )


def test_scaling_and_overrides_follow_the_preset() -> None:
    """layers=, blocks= and dtype= scale and override as preset() does; the dtype otherwise comes from the config."""
    got = from_hf_config(config("nemotron-h-8b"), layers=6, blocks=8, dtype="float32")
    assert got == preset("nemotron-h-8b", layers=6, blocks=8, dtype="float32")
    assert {g.dtype for g in from_hf_config({**config("llama-3.1-8b"), "torch_dtype": "float16"}).groups} == {
        "float16"
    }


def test_layer_types_lists_as_transformers_writes_them() -> None:
    """layer_types / layers_block_type lists (transformers 5's own form) give the same groups as the older fields."""
    qwen = config("qwen3-next-80b")
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)]
    assert from_hf_config({**qwen, "full_attention_interval": None, "layer_types": types}) == preset(
        "qwen3-next-80b"
    )
    nemo = config("nemotron-h-8b")
    pattern = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
    blocks = [pattern[c] for c in nemo.pop("hybrid_override_pattern")]
    assert from_hf_config({**nemo, "layers_block_type": blocks}) == preset("nemotron-h-8b")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"layer_types": ["full_attention", "chunked_attention"], "num_hidden_layers": 2}, "layer_types[1]"),
        ({"linear_key_head_dim": None}, "linear_key_head_dim"),
        ({"torch_dtype": "float64"}, "torch_dtype"),
        (
            {"layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_hidden_layers": 5},
            "num_hidden_layers",
        ),
        ({"num_key_value_heads": 0}, "num_key_value_heads"),
        ({"linear_num_value_heads": None}, "linear_num_value_heads"),
    ],
)
def test_unmappable_fields_are_named(change: dict[str, Any], field: str) -> None:
    """A field from_hf_config cannot read or map is a ConfigError naming that field."""
    with pytest.raises(ConfigError) as err:
        from_hf_config({**config("qwen3-next-80b"), **change})
    assert field in str(err.value)


def test_unreadable_files_are_config_errors(tmp_path: Path) -> None:
    """A missing file, a non-JSON file and a JSON non-object are ConfigErrors naming the file."""
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    for path in (tmp_path / "missing.json", bad):
        with pytest.raises(ConfigError, match=r"config\.json|missing\.json"):
            from_hf_config(path)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a JSON object"):
        from_hf_config(bad)


def test_reading_a_config_imports_neither_torch_nor_transformers() -> None:
    """import akv and from_hf_config stay cheap: neither loads torch or transformers."""
    code = (
        "import sys, akv, akv.presets as p;"
        f"p.from_hf_config({str(CONFIGS / 'gemma-3-27b.json')!r});"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def akv_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "akv", *argv], capture_output=True, text=True, timeout=60)


def test_cli_hf_config_plans_as_the_preset() -> None:
    """akv plan --hf-config FILE prints the plan of the preset the config describes; mistakes exit 64 in one line."""
    tp = ["--prefill-tp", "4", "--decode-tp", "2", "--json"]
    by_config = akv_cli("plan", "--hf-config", str(CONFIGS / "qwen3-next-80b.json"), *tp)
    by_preset = akv_cli("plan", "--preset", "qwen3-next-80b", *tp)
    assert by_config.returncode == 0, by_config.stderr
    assert json.loads(by_config.stdout) == json.loads(by_preset.stdout)
    both = akv_cli("plan", "--hf-config", str(CONFIGS / "llama-3.1-8b.json"), "--preset", "llama-3.1-8b", *tp)
    assert both.returncode == 64 and both.stderr.count("\n") == 1 and "exclude each other" in both.stderr
    odd = akv_cli("prefill", "--tp-size", "3", "--hf-config", str(CONFIGS / "llama-3.1-8b.json"))
    assert odd.returncode == 64 and odd.stderr.count("\n") == 1 and "--tp-size 3" in odd.stderr


def test_bench_takes_a_hf_config_as_it_takes_a_preset() -> None:
    """`akv bench --hf-config` plans the workloads of the matching preset; with --preset it exits 64."""
    from akv.bench.run import preset_workloads

    path = str(CONFIGS / "qwen3-next-80b.json")
    by_config, pairs_config = preset_workloads("qwen3_next", path)
    by_preset, pairs_preset = preset_workloads("qwen3-next-80b")
    assert [(w.prefill_tp, w.decode_tp, w.layout) for w in by_config] == [
        (w.prefill_tp, w.decode_tp, w.layout) for w in by_preset
    ]
    assert [p[2:] for p in pairs_config] == [p[2:] for p in pairs_preset]
    out = subprocess.run(
        [sys.executable, "-m", "akv", "bench", "--preset", "llama-3.1-8b", "--hf-config", path],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 64 and "exclude each other" in out.stderr
