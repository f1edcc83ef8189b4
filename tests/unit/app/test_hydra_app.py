"""app/hydra_app.py: the command line as Hydra's own parser reads it (overrides before and
after its flags), config folders made absolute, a builder's free-form settings add-or-set."""

from __future__ import annotations

from ampsweep.app import hydra_app


def test_the_command_line_is_read_by_hydras_own_parser(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    parsed = hydra_app.hydra_args(
        ["-m", "precision=fp32,fp16", "--config-name", "other", "-cp=conf", "model.args.x=1"]
    )
    assert parsed.multirun and parsed.config_name == "other"
    assert parsed.config_path == str(tmp_path / "conf")  # absolute: Hydra reads it so
    assert parsed.overrides == ["precision=fp32,fp16", "++model.args.x=1"]
    assert hydra_app.informational(hydra_app.hydra_args(["--cfg", "job"]))
    assert not hydra_app.informational(parsed)


def test_hydras_private_entry_points_that_ampsweep_calls_are_still_there():
    # hydra-core 1.3.8: the only places these are defined (see app/hydra_app.py's imports)
    import inspect

    from hydra._internal import hydra as internal_hydra
    from hydra._internal import utils

    assert callable(internal_hydra.Hydra.create_main_hydra2)
    assert {"task_function", "overrides"} <= set(
        inspect.signature(internal_hydra.Hydra.multirun).parameters
    )
    assert callable(utils._run_hydra) and callable(utils.create_automatic_config_search_path)
    parsed = utils.get_args_parser().parse_args(["-m", "precision=fp32"])
    assert parsed.multirun and parsed.overrides == ["precision=fp32"]
