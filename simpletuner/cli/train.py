"""``simpletuner train``, also run on its own: ``accelerate launch simpletuner/train.py --config cfg.json``
(the entry file :mod:`simpletuner.train` calls :func:`main` here)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from simpletuner.cli.arguments import add_config_arguments, add_log_level_argument
from simpletuner.exit_codes import first_line
from simpletuner.startup import StartupTimeline, quiet_gc_while_importing

if TYPE_CHECKING:
    from simpletuner.hub import HubSnapshot, UploadTarget


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``simpletuner train``'s options (also those of ``python -m simpletuner.train``)."""
    parser.description = "Train from a JSON config."
    add_config_arguments(
        parser,
        required=True,
        config_help="path to the training JSON",
        set_help="override a config key (dotted for nested keys; JSON values), e.g. --set max_train_steps=10",
    )
    parser.add_argument(
        "--preset",
        metavar="NAME",
        help="fill the keys the config (and the launch) leave unset from a memory preset "
        "(`simpletuner estimate --list-presets`); the effective values are logged",
    )
    add_log_level_argument(
        parser, help="our log lines from this level (DEBUG: ours only; third-party libraries stay at INFO)"
    )
    parser.add_argument(
        "--peak-tflops",
        type=positive_tflops,
        metavar="TFLOPS",
        help="the GPU's dense peak for this run's precision, for MFU (overrides the GPU table)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="output_dir holds an earlier run: remove its checkpoints, weights, validation images and "
        "logs, then start afresh (without it such a run is refused; other files there are kept)",
    )
    # The command that resumes this run, named by the line a stop signal ends with: `simpletuner demo` passes
    # `simpletuner train --config <its config>` (its own command would start over: it passes --overwrite).
    parser.add_argument("--resume-command", help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m simpletuner.train`` / ``accelerate launch simpletuner/train.py``."""
    parser = argparse.ArgumentParser(prog="simpletuner train")
    add_arguments(parser)
    return parser


def positive_tflops(text: str) -> float:
    """argparse type of ``--peak-tflops``: a positive number."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of TFLOPS, got {text!r}")
    return value


def prepare_config(config_path: str, overrides=(), environ=None, launch_command="auto", preset: str | None = None):
    """The run's validated config and where each launcher-settable key's value came from.

    Merges what ``accelerate launch`` was asked for (configuration/launcher.py), checks the
    environment's PYTORCH_CUDA_ALLOC_CONF, and reports every problem at once before any model
    loads. ``launch_command``: "auto" reads the launcher above this process; tests pass one.
    ``preset``: a memory preset's name; it fills only what the config and the launch leave unset.
    Returns the loaded config, the source of each launcher-settable key, and the lines to log
    about the preset (empty without one).
    """
    import os
    from pathlib import Path

    from simpletuner.configuration import ConfigError, LoadedConfig, validate_config
    from simpletuner.configuration.alloc_conf import ALLOC_CONF_VAR, check_alloc_conf
    from simpletuner.configuration.launcher import launcher_command_from_environment, resolve_launcher_settings
    from simpletuner.configuration.loader import apply_overrides, read_raw_config, with_settled_family

    environ = os.environ if environ is None else environ
    path = Path(config_path)
    raw = read_raw_config(path, overrides)
    problems: list[str] = []
    checked, hub = _hub_model_configs(raw, environ, problems)
    vae_checked, hub_vae = _hub_model_configs(raw, environ, problems, "pretrained_vae_model_name_or_path")
    cn_checked, hub_controlnet = _hub_model_configs(raw, environ, problems, "controlnet_model_name_or_path")
    command = launcher_command_from_environment(environ) if launch_command == "auto" else launch_command
    sources: dict[str, str] = {}
    try:
        launch = resolve_launcher_settings(raw, environ, command, config_source=str(path))
    except ConfigError as exc:
        problems += exc.problems
    else:
        raw = apply_overrides(raw, launch.overrides)
        sources = {key: setting.source for key, setting in launch.settings.items()}
    notes: list[str] = []
    if preset is not None:
        raw, notes = _with_preset(raw, preset, sources, problems)
    problems += check_alloc_conf(environ.get(ALLOC_CONF_VAR)).errors()  # its warnings: Trainer._log_settings_in_force
    try:
        # a hub id is checked as its snapshot folder (family, components); the run's raw config keeps the id
        config = validate_config(
            {**raw, **checked, **vae_checked, **cn_checked}, base_dir=path.parent, source=str(path)
        )
    except ConfigError as exc:
        problems += exc.problems
    if problems:
        raise ConfigError(problems, str(path))
    _check_hub_datasets(config, environ, path)
    loaded = LoadedConfig(
        config=config,
        raw=with_settled_family(raw, config),
        path=path,
        hub=hub,
        hub_vae=hub_vae,
        hub_controlnet=hub_controlnet,
    )
    return loaded, sources, notes


def _with_preset(raw: dict, preset: str, sources: dict[str, str], problems: list[str]) -> tuple[dict, list[str]]:
    """``raw`` with memory preset ``preset`` filling what it leaves unset, and the lines to log; the keys it
    fills get their source in ``sources``; an unknown preset joins ``problems``."""
    from simpletuner.memory.presets import apply_preset

    try:
        merged, notes = apply_preset(raw, preset)
    except ValueError as exc:
        problems.append(f"--preset {preset}: {exc}")
        return raw, []
    for key in ("mixed_precision", "gradient_accumulation_steps", "enable_compile"):
        if key not in raw and key in merged:
            sources[key] = f"from preset {preset}; neither the config nor the launch sets it"
    return merged, notes


def _check_hub_datasets(config, environ, path) -> None:
    """Every trained ``type: huggingface`` dataset fetched into the Hub cache and its columns checked, before
    ``output_dir`` is written; ConfigError with one line per problem."""
    if not any(d.type == "huggingface" for d in config.datasets or []):
        return
    from simpletuner.configuration import ConfigError
    from simpletuner.data_backend.hub_dataset import check_hub_datasets  # imports torch: only where needed

    if problems := check_hub_datasets(config, environ):
        raise ConfigError(problems, str(path))


def _hub_model_configs(
    raw: dict, environ, problems: list[str], key: str = "pretrained_model_name_or_path"
) -> tuple[dict, HubSnapshot | None]:
    """Where ``key`` (``pretrained_model_name_or_path``, ``pretrained_vae_model_name_or_path`` or
    ``controlnet_model_name_or_path``) is a hub id: its configs fetched into the Hub cache (no weights yet) and the
    key pointing at that snapshot for the checks; else nothing. A failure joins ``problems``."""
    from simpletuner.hub import (
        CONTROLNET_KEY,
        VAE_KEY,
        HubError,
        resolve_config_controlnet,
        resolve_config_model,
        resolve_config_vae,
    )

    resolvers = {VAE_KEY: resolve_config_vae, CONTROLNET_KEY: resolve_config_controlnet}
    try:
        hub = resolvers.get(key, resolve_config_model)(raw, environ)
    except HubError as exc:
        problems.append(f"{key}: {exc}")
        return {}, None
    return ({key: str(hub.folder)}, hub) if hub is not None else ({}, None)


def run_training(
    config_path: str,
    overrides=(),
    log_level: str = "INFO",
    peak_tflops: float | None = None,
    preset: str | None = None,
    overwrite: bool = False,
    resume_command: str | None = None,
    timeline: StartupTimeline | None = None,
):
    """Load the config, build the run's StateTracker and Trainer, train. Returns the TrainResult.

    ``timeline``: the start-up timeline :func:`_main` began (else one begins here); the config and the
    imports are marked on it, and the trainer goes on with it and logs it after the first step."""
    from simpletuner.state import StateTracker
    from simpletuner.training.runlog import configure_logging

    timeline = startup_timeline() if timeline is None else timeline
    configure_logging(log_level)
    loaded, sources, preset_notes = prepare_config(config_path, overrides, preset=preset)
    upload = _check_hub_upload(loaded)
    timeline.mark("config")
    if loaded.hub is not None:  # the weights of the components the family loads, once the config is known good
        loaded = _download_hub_weights(loaded)
    for field in ("hub_vae", "hub_controlnet"):
        if getattr(loaded, field) is not None:
            loaded = _download_hub_component_weights(loaded, field)
    if loaded.hub is not None or loaded.hub_vae is not None or loaded.hub_controlnet is not None:
        timeline.mark("download")
    # Only now torch and the model libraries (seconds to import): a config error is answered without them.
    with quiet_gc_while_importing():
        from simpletuner.training.trainer import Trainer
    timeline.mark("imports")

    state = StateTracker(loaded.config, loaded.raw)
    state.setting_sources = sources
    state.startup_notes = preset_notes
    state.resume_command = resume_command
    state.hub_upload = upload
    if loaded.hub is not None:
        state.hub_model = f"{loaded.hub.repo_id}@{loaded.hub.commit}"
        state.startup_notes.insert(0, _hub_line(loaded.hub))
    if loaded.hub_vae is not None:  # its commit is in the run identity: the trainer reads it from the folder
        state.startup_notes.insert(
            int(loaded.hub is not None), _hub_line(loaded.hub_vae, "pretrained_vae_model_name_or_path")
        )
    if loaded.hub_controlnet is not None:  # as the VAE's: its commit is in the run identity
        state.startup_notes.append(_hub_line(loaded.hub_controlnet, "controlnet_model_name_or_path"))
    trainer = Trainer(state, peak_tflops=peak_tflops, overwrite=overwrite, startup=timeline)
    if not _is_single_process():
        _KEEP_ALIVE.append(trainer)  # freed by the process's end, not here: see end_process
    return trainer.train()


def _check_hub_upload(loaded) -> UploadTarget | None:
    """push_to_hub: a token that may write the repo (which is created, private unless model_card_private is
    false), checked before anything is downloaded or written; ConfigError naming the repo and the fix.

    Only rank 0 uploads, so only rank 0 checks (the other ranks, and the other nodes, need no token or network):
    when it refuses, its error ends the launch."""
    config = loaded.config
    if not config.push_to_hub or not _is_main_rank():
        return None
    from simpletuner.configuration import ConfigError
    from simpletuner.hub import HubError, check_upload_access

    try:
        return check_upload_access(config.hub_repo_id, config.model_card_private)
    except HubError as exc:
        raise ConfigError([str(exc)], str(loaded.path)) from None


def _download_hub_weights(loaded):
    """``loaded`` with its hub model's weights in the Hub cache (the snapshot its configs came from), logged."""
    import dataclasses

    from simpletuner.configuration import ConfigError
    from simpletuner.configuration.families import FAMILIES
    from simpletuner.hub import HubError, resolve_model

    hub = loaded.hub
    components = FAMILIES[loaded.config.model_family].components
    try:
        snapshot = resolve_model(hub.repo_id, hub.commit, components=components)
    except HubError as exc:
        raise ConfigError([f"pretrained_model_name_or_path: {exc}"], str(loaded.path)) from None
    snapshot = dataclasses.replace(snapshot, revision=hub.revision)
    return dataclasses.replace(loaded, hub=snapshot)


def _download_hub_component_weights(loaded, field: str):
    """``loaded`` with the weights of the one-component hub repo in its ``field`` (``hub_vae``: the separate VAE,
    ``hub_controlnet``: the ControlNet) in the Hub cache (the snapshot its config came from)."""
    import dataclasses

    from simpletuner.configuration import ConfigError
    from simpletuner.hub import CONTROLNET_KEY, VAE_KEY, HubError, resolve_controlnet, resolve_vae

    key, resolve = (VAE_KEY, resolve_vae) if field == "hub_vae" else (CONTROLNET_KEY, resolve_controlnet)
    hub = getattr(loaded, field)
    try:
        snapshot = resolve(hub.repo_id, hub.commit, weights=True)
    except HubError as exc:
        raise ConfigError([f"{key}: {exc}"], str(loaded.path)) from None
    return dataclasses.replace(loaded, **{field: dataclasses.replace(snapshot, revision=hub.revision)})


def _hub_line(hub: HubSnapshot, key: str = "pretrained_model_name_or_path") -> str:
    """The start-up line naming the snapshot the hub id of ``key`` resolved to."""
    revision = hub.revision or "main"
    return f"{key} {hub.repo_id!r} (revision {revision}): the Hub snapshot {hub.describe()}"


#: The trainer of a rank of a multi-process launch, kept until the process ends in :func:`end_process`.
_KEEP_ALIVE: list = []


def _is_single_process() -> bool:
    import os

    return os.environ.get("WORLD_SIZE", "1") in ("", "1")


def end_process(code: int) -> None:
    """End the ``train`` process with ``code``.

    A rank of a multi-process launch leaves with ``os._exit`` once its output is flushed, without
    freeing the trainer: freeing its DDP model destroys the Gloo process group while holding the
    GIL, and that destructor joins Gloo's worker threads, one of which may still be releasing the
    tensors of a finished collective, which needs the GIL: a deadlock (pytorch/pytorch#56297; seen
    as a rank hanging after its run completed). Everything a run writes is closed and fsynced
    before ``train()`` returns, and the process group was shut down by ``end_training``.
    A single process exits normally.
    """
    import logging
    import os

    from simpletuner.training.reliability import exit_on_signal

    exit_on_signal(code)  # the run is over: a signal during shutdown exits with its code, no traceback
    if not _is_single_process():
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)


def _is_main_rank() -> bool:
    """Rank 0 of a launch (``RANK``, set by ``accelerate launch`` / torchrun), or a single process."""
    import os

    return os.environ.get("RANK", "0") in ("", "0")


def main(argv: list[str] | None = None) -> int:
    """``python -m simpletuner.train ARGV`` (and ``accelerate launch simpletuner/train.py``); returns the exit code."""
    return _with_signals(lambda: build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """``simpletuner train``: train from the parsed arguments; returns the exit code.

    A rank of a multi-process launch ends its process here, as train.py's ranks do (:func:`end_process`).
    """
    code = _with_signals(lambda: args)
    if not _is_single_process():
        end_process(code)
    return code


def _with_signals(parse) -> int:
    """Train from ``parse()``'s arguments with the run's signal handlers installed first."""
    from simpletuner.training.reliability import (
        RunSignals,
        RunStopped,
    )  # standard library only: installed before the heavy imports

    with RunSignals():  # SIGTERM / SIGINT in any phase: one line and 143 / 130, never a traceback
        try:
            return _main(parse())
        except RunStopped as exc:  # a signal while _main imports, before its own handlers
            print(_stopped_line(exc), file=sys.stderr)
            return exc.exit_code


def _stopped_line(exc) -> str:
    """The line a stopped run ends with: a signal's message already starts with "stopped by"."""
    text = str(exc)
    return text if text.startswith("stopped by ") else f"stopped: {text}"


def _peer_stopped(exc: Exception) -> bool:
    """Whether a collective failed because another process of a multi-process run went away (a
    signal stopped it outside the step loop, or it failed): not a bug here, and not this rank's story."""
    if _is_single_process():
        return False
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, getattr(dist, "DistError", ())) or any(
        word in text for word in ("Connection closed by peer", "Connection reset by peer")
    )


def _same_on_every_rank(exc: Exception) -> bool:
    """A user error every rank of a launch meets alike (printed by rank 0 only)."""
    from simpletuner.configuration import ConfigError
    from simpletuner.training.checkpoint_verify import ResumeRefused
    from simpletuner.training.run_folder import RunFolderTaken  # imports torch: only asked on ranks other than 0

    return isinstance(exc, (ConfigError, ResumeRefused, RunFolderTaken))


def startup_timeline() -> StartupTimeline:
    """A start-up timeline counting from this process's start, and from the launcher's where ``accelerate
    launch`` started this process (found in ``/proc``, as the launch settings are)."""
    timeline = StartupTimeline(since_process_start=True)  # before the lookup's imports: they count as "config"
    from simpletuner.configuration.launcher import find_launcher

    launcher = find_launcher()
    if launcher is not None:
        timeline.launched_by(launcher[0])
    return timeline


def _main(args: argparse.Namespace) -> int:
    import signal

    timeline = startup_timeline()
    # No torch here: a config error is reported before it is imported (run_training imports it after the check).
    from simpletuner.configuration import ConfigError
    from simpletuner.diskspace import NoSpace
    from simpletuner.training.launch import LaunchError
    from simpletuner.training.reliability import RunSignals, RunStopped

    try:
        run_training(
            args.config,
            args.overrides,
            args.log_level,
            peak_tflops=args.peak_tflops,
            preset=args.preset,
            overwrite=args.overwrite,
            resume_command=args.resume_command,
            timeline=timeline,
        )
    except NoSpace as exc:  # a full disk (exit 5): the message says how much, where, and what is free
        if _is_main_rank() or not exc.agreed:  # an agreed one is rank 0's, raised on every rank: printed once
            print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except RunStopped as exc:  # a signal (143/130), non-finite (3), out of memory (4): the message says what next
        print(_stopped_line(exc), file=sys.stderr)
        return exc.exit_code
    except (ConfigError, ValueError, LaunchError) as exc:  # user errors: the message says what to fix
        if args.log_level == "DEBUG":
            raise
        if _is_main_rank() or not _same_on_every_rank(exc):
            print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - a bug of ours: never exit with a code that means something else
        from simpletuner.exit_codes import report_internal_error

        signals = RunSignals.installed()
        if (
            signals is not None and signals.signum is not None
        ):  # a signal came first (e.g. the sibling ranks it stopped broke a collective)
            name = signal.Signals(signals.signum).name
            print(f"stopped by {name} during {signals.received_in}: then {type(exc).__name__}: {exc}", file=sys.stderr)
            return 128 + signals.signum
        if _peer_stopped(exc):
            print(
                "stopped: another process of this run stopped or failed first, so this one cannot go on (that "
                f"process's message says why): {first_line(exc)}",
                file=sys.stderr,
            )
            return 1
        return report_internal_error(exc, "train")
    return 0


if __name__ == "__main__":
    end_process(main())
