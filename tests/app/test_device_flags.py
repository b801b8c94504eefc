"""`--device` and `--gpu-layers`: from the command line and config to load_model, and what the user sees.

This machine has no CuPy: `cuda` must fail in one line with status 2, `auto` must run on the CPU and say why.
The device path itself (engine.gpu on NumPy) is tested in tests/engine/test_gpu_backend.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from chatapp import cli
from chatapp.bench import run_bench
from chatapp.chat_state import stats_line
from chatapp.settings import ConfigError, load_settings
from engine import SettingsError, load_model
from engine import loader as engine_loader
from engine.chat import ChatSession
from engine.events import Message, TurnStats
from engine.sampling import SamplingSettings
from tests.engine.synthetic import write_tiny_model
from tests.reliability.support import PYTHON, REPO, child_env

NO_CUPY = importlib.util.find_spec("cupy") is None
needs_no_cupy = pytest.mark.skipif(not NO_CUPY, reason="checks a machine without CuPy; this one has it")
CUDA_ERROR = (
    "chatapp: error: device cuda is not usable: cupy is not installed (install the gpu extra: pip install '.[gpu]')"
)
AUTO_WARNING = "chatapp: warning: no GPU: cupy is not installed; running on the CPU"


@needs_no_cupy
@pytest.mark.parametrize("command", [["run", "-p", "hi", "-n", "2"], ["bench", "-p", "8", "-n", "2", "-r", "1"]])
def test_cuda_without_cupy_exits_2_in_one_line(tmp_path: Path, smollm2_path: Path, command: list[str]) -> None:
    done = subprocess.run(
        [PYTHON, "-m", "chatapp", *command, "-m", str(smollm2_path), "--device", "cuda"],
        cwd=REPO,
        env=child_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.splitlines() == [CUDA_ERROR]


@needs_no_cupy
@pytest.mark.parametrize("mode", [[], ["--chat"]], ids=["completion", "chat"])
def test_auto_runs_on_the_cpu_and_says_why_once(
    isolated_dirs, smollm2_path: Path, capsys: pytest.CaptureFixture[str], mode: list[str]
) -> None:
    args = ["run", "-m", str(smollm2_path), "-n", "3", "--temp", "0", "-p", "Hello", "--device", "auto", *mode]
    status = cli.main(args)
    out, err = capsys.readouterr()
    assert status == 0, err
    assert [line for line in err.splitlines() if "GPU" in line] == [AUTO_WARNING]
    assert len(out.strip()) > len("Hello") and (mode or out.startswith("Hello"))


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--gpu-layers", "-2"], "gpu_layers: expected an integer ≥ -1 (-1 = all), got '-2'"),
        (["--gpu-layers", "1.5"], "gpu_layers: expected an integer ≥ -1 (-1 = all), got '1.5'"),
        (["-ngl", "many"], "gpu_layers: expected an integer ≥ -1 (-1 = all), got 'many'"),
        (["--device", "tpu"], "device: expected one of 'auto', 'cpu', 'cuda', got 'tpu'"),
    ],
    ids=["negative", "fraction", "word", "device"],
)
@pytest.mark.parametrize("command", [["run", "-p", "hi"], ["bench"], []], ids=["run", "bench", "tui"])
def test_bad_values_are_refused_in_one_line(
    isolated_dirs, capsys: pytest.CaptureFixture[str], command: list[str], args: list[str], named: str
) -> None:
    """Checked against the settings schema before the model is looked up (the path does not exist)."""
    status = cli.main([*command, "-m", "/nonexistent/model.gguf", *args])
    out, err = capsys.readouterr()
    assert status == 2
    assert out == ""
    assert err.splitlines() == [f"chatapp: error: command line: {named}"]


def test_settings_defaults_alias_and_config(isolated_dirs, tmp_path: Path) -> None:
    settings = load_settings()
    assert (settings.device, settings.gpu_layers) == ("auto", -1)
    assert load_settings({"device": "gpu", "gpu_layers": "12"}).device == "cuda"
    assert load_settings({"gpu_layers": "12"}).gpu_layers == 12
    config = tmp_path / "config.toml"
    config.write_text('device = "cpu"\ngpu_layers = 8\n', encoding="utf-8")
    assert (load_settings(config_file=config).device, load_settings(config_file=config).gpu_layers) == ("cpu", 8)
    config.write_text("gpu_layers = -5\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"line 1: gpu_layers: expected an integer ≥ -1"):
        load_settings(config_file=config)


def load_model_kwargs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, argv: list[str]) -> dict[str, Any]:
    """What `chatapp ARGV -m FILE` hands load_model, which stops the command there: exit code 2, "stop here"."""
    seen: dict[str, Any] = {}

    def fake_load_model(path, **kwargs):
        seen.update(kwargs)
        raise SettingsError("stop here")

    monkeypatch.setattr(engine_loader, "load_model", fake_load_model)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert cli.main([*argv, "-m", str(model)]) == 2
    return seen


@pytest.mark.parametrize("command", [["run", "-p", "hi"], ["bench"]])
def test_flags_and_config_reach_load_model(
    isolated_dirs, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, command
) -> None:
    seen = load_model_kwargs(monkeypatch, tmp_path, [*command, "--device", "cuda", "--gpu-layers", "7"])
    assert (seen["device"], seen["gpu_layers"]) == ("cuda", 7)
    (isolated_dirs["config"] / "config.toml").write_text('device = "gpu"\ngpu_layers = 3\n', encoding="utf-8")
    seen = load_model_kwargs(monkeypatch, tmp_path, command)
    assert (seen["device"], seen["gpu_layers"]) == ("cuda", 3)
    assert capsys.readouterr().err.splitlines() == ["chatapp: error: stop here"] * 2


# ---- where the device shows --------------------------------------------------------------------------------


@pytest.fixture
def offloaded(tmp_path: Path):
    """A tiny llama with every layer and the output on the NumPy device backend."""
    tiny = write_tiny_model(tmp_path / "tiny.gguf", "llama")
    return load_model(tiny.path, n_ctx=64, device="numpy")


def test_bench_reports_the_device(offloaded, capsys: pytest.CaptureFixture[str]) -> None:
    assert offloaded.device == "numpy (test backend), 2/2 layers + output"
    assert run_bench(offloaded, 8, 4, 1, as_json=True) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["device"] == offloaded.device and result["decode_tok_s"] > 0
    run_bench(offloaded, 8, 4, 1, as_json=False)
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "| model | device | threads | test | t/s |"
    assert f"| {offloaded.device} |" in table[2]


def test_reply_stats_carry_the_device(offloaded) -> None:
    chat = ChatSession(offloaded, SamplingSettings(temperature=0.0, max_tokens=3))
    stats = [e for e in chat.stream_reply([Message("user", "hi")]) if isinstance(e, TurnStats)]
    assert [s.device for s in stats] == [offloaded.device]
    assert stats_line(stats[0]).endswith(f" · {offloaded.device}")
    assert offloaded.device not in stats_line(dataclasses.replace(stats[0], device=""))  # older stats: no device


@needs_no_cupy
def test_gpu_check_script_fails_cleanly_without_cupy(tmp_path: Path) -> None:
    done = subprocess.run(
        [PYTHON, "benchmarks/gpu_check.py", "model.gguf"],
        cwd=REPO,
        env=child_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["gpu_check: no GPU: cupy is not installed"]
