"""app/hydra_app.py: the Hydra entry points it runs a command through."""

from __future__ import annotations


def test_hydras_private_entry_points_that_ampsweep_calls_are_still_there():
    # hydra-core 1.3.8: the only places these are defined (app/hydra_app.py, command_line.py)
    import inspect

    from hydra._internal import hydra as internal_hydra
    from hydra._internal import utils
    from hydra._internal.callbacks import Callbacks
    from hydra.core.utils import run_job

    assert callable(internal_hydra.Hydra.create_main_hydra2)
    assert {"task_function", "overrides"} <= set(
        inspect.signature(internal_hydra.Hydra.multirun).parameters
    )
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
