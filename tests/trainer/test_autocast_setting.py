"""The trainer's bf16 autocast knob (trainer/settings.py `autocast`, `train --autocast`, ADAPTIVE_SPEC_AUTOCAST)
reaches the training steps, and a bad value is refused with its name."""

from __future__ import annotations

import pytest

from cli import build_parser
from trainer.process.build import online_settings
from trainer.settings import TrainerSettings


def test_the_flag_the_environment_and_a_child_trainers_argv_reach_the_training_steps(tmp_path):
    assert TrainerSettings().autocast == "auto"
    assert build_parser().parse_args(["train", "--autocast", "off"]).autocast == "off"
    settings = TrainerSettings.from_env({"ADAPTIVE_SPEC_AUTOCAST": "bf16"}, data_dir=tmp_path)
    assert online_settings(settings).lora.autocast == "bf16"
    argv = settings.argv()
    assert argv[argv.index("--autocast") + 1] == "bf16"
    assert "--autocast" not in TrainerSettings(data_dir=tmp_path).argv()  # the default is the child's own


def test_a_bad_value_is_refused_with_the_name_to_fix():
    with pytest.raises(ValueError, match="ADAPTIVE_SPEC_AUTOCAST must be one of auto, bf16, off"):
        TrainerSettings.from_env({"ADAPTIVE_SPEC_AUTOCAST": "fp8"})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--autocast", "fp8"])
