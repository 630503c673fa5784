"""``simpletuner push OUTPUT_DIR [--repo ID]``: upload a finished run (or one of its checkpoints) to the Hub.

The same upload ``push_to_hub`` makes at the end of a run (simpletuner/training/publish.py): the final weights, the
model card (written to ``OUTPUT_DIR/README.md`` too), the run's config and the last validation images; with
``--checkpoint N`` the upload ``push_checkpoints_to_hub`` makes of ``checkpoint-N``. The token is checked and the
repo created (private unless the run's config or ``--public`` says otherwise) before anything is sent; a failed
upload is retried, then reported (exit 6). documentation/QUICKSTART.md, "Upload to the Hub".
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from simpletuner.cli.arguments import add_log_level_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output_dir", help="the run's output folder (it holds config.json and final_weights.json)")
    parser.add_argument(
        "--repo",
        help="the repo to upload to: org/name, or name for the token's account (default: the run's hub_model_id, "
        "else its tracker_project_name)",
    )
    visibility = parser.add_mutually_exclusive_group()
    visibility.add_argument(
        "--public", dest="private", action="store_false", default=None, help="create the repo public"
    )
    visibility.add_argument(
        "--private", dest="private", action="store_true", help="create the repo private (the default)"
    )
    parser.add_argument(
        "--checkpoint",
        type=int,
        metavar="N",
        help="upload checkpoint-N (to checkpoint-N/ and, a LoRA's adapter, the repo's root) instead of the final "
        "weights",
    )
    add_log_level_argument(parser)


def run(args: argparse.Namespace) -> int:
    from simpletuner.exit_codes import BAD_INPUT, NETWORK, OK
    from simpletuner.training.runlog import configure_logging

    configure_logging(args.log_level)

    try:
        ok = push(Path(args.output_dir), args.repo, args.private, args.checkpoint)
    except ValueError as exc:  # HubError, ConfigError, a run folder that holds nothing to upload
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    return OK if ok else NETWORK


def push(output_dir: Path, repo: str | None, private: bool | None, checkpoint: int | None = None) -> bool:
    """Upload ``output_dir``'s final weights (or ``checkpoint-N``) and wait; True when the upload was sent.

    Raises:
        ValueError: the folder holds no run, no final weights or no such checkpoint; the repo id is not one; no
            token, a read-only one, no network (HubError, one line naming the repo and the fix).
    """
    from simpletuner.configuration.model_folder import normalise_repo_id, repo_id_problem
    from simpletuner.hub import check_upload_access
    from simpletuner.training import publish

    config, raw = read_run_config(output_dir)
    repo_id = normalise_repo_id(repo) if repo else config.hub_repo_id
    if problem := repo_id_problem(repo_id):
        raise ValueError(f"--repo: {problem}")
    if checkpoint is None:
        publish.read_final_record(output_dir)  # a run that has not finished: said before the token is checked
    else:
        folder = _checkpoint_folder(output_dir, checkpoint)
    target = check_upload_access(repo_id, config.model_card_private if private is None else private)
    facts = publish.RunFacts(output_dir, _base_model(raw))
    if checkpoint is None:
        job = publish.final_job(config, facts, target.repo_id)
    else:
        job = publish.checkpoint_job(config, facts, target.repo_id, folder, checkpoint)
    staging = output_dir / publish.STAGING / f"push-{os.getpid()}"
    uploader = publish.Publisher(target, staging, background=False, quiet=False)
    uploader.submit(job)
    sent = uploader.finish()
    if sent:
        print(f"uploaded {job.what} of {output_dir} to {target.url}")
    return sent


def read_run_config(output_dir: Path):
    """The config the run trained with (``output_dir/config.json``), read without checking its files (the
    datasets and the model need not be on this machine) and its raw dict (also ``simpletuner export``'s).

    Raises:
        ValueError: no config.json there, or one that cannot be read or is not a valid config.
    """
    import orjson

    from simpletuner.configuration import ConfigError, validate_config

    path = output_dir / "config.json"
    try:
        raw = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        raise ValueError(f"{output_dir} is not a run's output folder: it has no config.json") from None
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ValueError(f"{path} cannot be read: {exc}") from None
    try:
        return validate_config(raw, base_dir=output_dir, source=str(path), check_files=False), raw
    except ConfigError as exc:
        raise ValueError(f"the run's config {path} cannot be read: {exc}") from None


def _checkpoint_folder(output_dir: Path, step: int) -> Path:
    from simpletuner.training.checkpoint import is_complete

    folder = output_dir / f"checkpoint-{step}"
    if not is_complete(folder):
        have = sorted(p.name for p in output_dir.glob("checkpoint-*") if is_complete(p))
        raise ValueError(
            f"{folder} is not a complete checkpoint (checkpoints there: {', '.join(have) or 'none'}): name one of them"
        )
    return folder


def _base_model(raw: dict) -> str | None:
    """The base model's Hub id where the run loaded one (config.json keeps the id as written)."""
    from simpletuner.hub import is_hub_model

    model = raw.get("pretrained_model_name_or_path")
    return model if isinstance(model, str) and is_hub_model(model) else None
