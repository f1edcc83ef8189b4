"""launch/hydra_app.py: the Hydra entry points it runs a command through; the command line as
Hydra's own parser reads it (overrides before and after its flags), config folders made
absolute, a builder's free-form settings add-or-set."""

from __future__ import annotations

from ampsweep.launch.hydra_app import hydra_args, informational


def test_hydras_private_entry_points_that_ampsweep_calls_are_still_there():
    # hydra-core 1.3.8: the only places these are defined (launch/hydra_app.py)
    import inspect

    from hydra._internal import hydra as internal_hydra
    from hydra._internal import utils
    from hydra._internal.callbacks import Callbacks
    from hydra.core.utils import run_job

    assert callable(internal_hydra.Hydra.create_main_hydra2)
    # a sweep: composed by compose_config, then what Hydra.multirun does after composing
    assert callable(Callbacks.on_multirun_start) and callable(Callbacks.on_multirun_end)
    assert callable(utils._run_hydra) and callable(utils.create_automatic_config_search_path)
    # a single run: composed by compose_config, then what Hydra.run does after composing
    assert {"config_name", "overrides", "run_mode", "with_log_configuration"} <= set(
        inspect.signature(internal_hydra.Hydra.compose_config).parameters
    )
    assert callable(Callbacks.on_run_start) and callable(Callbacks.on_run_end)
    assert {"hydra_context", "task_function", "config", "job_dir_key", "job_subdir_key"} <= set(
        inspect.signature(run_job).parameters
    )
    parsed = utils.get_args_parser().parse_args(["-m", "precision=fp32"])
    assert parsed.multirun and parsed.overrides == ["precision=fp32"]


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
