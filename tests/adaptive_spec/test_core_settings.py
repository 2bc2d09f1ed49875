"""What the core library reads from the environment (adaptive_spec/options.py, CoreSettings): the same
variables with the meanings they had when each module read its own, read when used rather than at import.

    .venv/bin/python -m pytest tests/adaptive_spec/test_core_settings.py -q
"""

from __future__ import annotations

from pathlib import Path

from adaptive_spec import models
from adaptive_spec.kernels import attention_cpu, cpu_linear, linear_bf16
from adaptive_spec.options import CoreSettings


def test_each_variable_keeps_its_name_and_meaning():
    assert CoreSettings.from_env({}) == CoreSettings(True, True, "auto", Path(".adaptive-spec"))
    given = {
        "ADAPTIVE_SPEC_COMPILE": " Off ",
        "ADAPTIVE_SPEC_CPU_ATTENTION": "0",
        "ADAPTIVE_SPEC_CPU_LINEAR": " 1 ",
        "ADAPTIVE_SPEC_DATA_DIR": "/srv/adaptive-spec",
    }
    assert CoreSettings.from_env(given) == CoreSettings(False, False, "1", Path("/srv/adaptive-spec"))
    # A switch is on for anything but 0, false, no or off: an empty value too (EnvSettings reads "" as not
    # given and "2" as off; these variables never did).
    assert CoreSettings.from_env({"ADAPTIVE_SPEC_COMPILE": "", "ADAPTIVE_SPEC_CPU_ATTENTION": "2"}).compile
    assert CoreSettings.from_env({"ADAPTIVE_SPEC_CPU_ATTENTION": "2"}).cpu_attention
    assert CoreSettings.from_env({"ADAPTIVE_SPEC_CPU_LINEAR": "AUTO"}).cpu_linear == "auto"
    assert not CoreSettings.from_env({"ADAPTIVE_SPEC_CPU_BF16_LINEAR": "off"}).cpu_bf16_linear
    assert CoreSettings.from_env({}).cpu_amx and not CoreSettings.from_env({"ADAPTIVE_SPEC_CPU_AMX": "0"}).cpu_amx


def test_the_modules_read_it_when_they_decide(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAPTIVE_SPEC_DATA_DIR", str(tmp_path))
    assert models.data_dir() == tmp_path
    monkeypatch.setenv("ADAPTIVE_SPEC_CPU_LINEAR", "no")
    assert not cpu_linear.enabled()
    monkeypatch.setenv("ADAPTIVE_SPEC_CPU_LINEAR", "1")
    assert cpu_linear.enabled()
    monkeypatch.setenv("ADAPTIVE_SPEC_CPU_ATTENTION", "false")
    assert attention_cpu.load(tmp_path / "extensions") is None  # turned off: nothing is built
    monkeypatch.setenv("ADAPTIVE_SPEC_CPU_BF16_LINEAR", "0")
    assert linear_bf16.load(tmp_path / "extensions") is None
