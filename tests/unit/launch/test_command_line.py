"""app/command_line.py: the command line as Hydra's own parser reads it (overrides before and
after its flags), config folders made absolute, a builder's free-form settings add-or-set."""

from __future__ import annotations

from ampsweep.launch.command_line import hydra_args, informational


def test_the_command_line_is_read_by_hydras_own_parser(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    parsed = hydra_args(
        ["-m", "precision=fp32,fp16", "--config-name", "other", "-cp=conf", "model.args.x=1"]
    )
    assert parsed.multirun and parsed.config_name == "other"
    assert parsed.config_path == str(tmp_path / "conf")  # absolute: Hydra reads it so
    assert parsed.overrides == ["precision=fp32,fp16", "++model.args.x=1"]
    assert informational(hydra_args(["--cfg", "job"]))
    assert not informational(parsed)
    assert informational(None)  # a line Hydra's parser refused trains nothing
