"""The idle-round knob (trainer/settings.py `idle_after_s`, `train --idle-after-s`, ADAPTIVE_SPEC_IDLE_AFTER_S)
reaches the online loop, 0 turns idle rounds off, and a bad value is refused."""

from __future__ import annotations

import pytest

from cli import build_parser
from trainer.process.build import online_settings
from trainer.settings import TrainerSettings


def test_the_flag_the_environment_and_a_child_trainers_argv_reach_the_loop(tmp_path):
    assert online_settings(TrainerSettings(data_dir=tmp_path)).idle_after_s == 30.0
    assert build_parser().parse_args(["train", "--idle-after-s", "5"]).idle_after_s == 5.0
    settings = TrainerSettings.from_env({"ADAPTIVE_SPEC_IDLE_AFTER_S": "90"}, data_dir=tmp_path)
    assert online_settings(settings).idle_after_s == 90.0
    argv = settings.argv()
    assert argv[argv.index("--idle-after-s") + 1] == "90.0"
    assert "--idle-after-s" not in TrainerSettings(data_dir=tmp_path).argv()  # the default is the child's own
    never = TrainerSettings.from_env({"ADAPTIVE_SPEC_IDLE_AFTER_S": "0"}, data_dir=tmp_path)
    assert online_settings(never).idle_after_s is None  # no idle rounds


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_bad_value_is_refused_with_the_name_to_fix(value):
    with pytest.raises(ValueError, match="ADAPTIVE_SPEC_IDLE_AFTER_S must be >= 0 seconds"):
        TrainerSettings.from_env({"ADAPTIVE_SPEC_IDLE_AFTER_S": value})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--idle-after-s", value])
