"""Uploads of a run to the Hugging Face Hub (``push_to_hub``, ``push_checkpoints_to_hub``, ``simpletuner push``).

What goes where (as SimpleTuner lays its repos out): the final weights (the files ``final_weights.json`` lists),
``README.md`` (the model card, :mod:`.model_card`), ``simpletuner_config.json`` (the run's config.json) and the
last validation step's images under ``assets/`` to the repo's root, the EMA weights under ``ema/``; each checkpoint
(with ``push_checkpoints_to_hub``) to ``checkpoint-N/`` and, a LoRA's adapter and card, to the root as well.

:class:`Publisher` makes each upload one commit, in order, on a thread of its own: a failed commit is retried,
then reported with the command that uploads it by hand; nothing it does raises into training. The files of a job
are hard-linked (else copied) into ``output_dir/.hub-upload/`` when it is queued, so checkpoint retention or a
later save cannot change what an upload sends. documentation/QUICKSTART.md, "Upload to the Hub".
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from simpletuner.exit_codes import first_line
from simpletuner.file_modes import write_atomic
from simpletuner.hub import UploadTarget
from simpletuner.models.spec import FINAL_RECORD
from simpletuner.training.ema import EMA_FOLDER
from simpletuner.training.model_card import CardFacts, model_card

logger = logging.getLogger(__name__)

#: Where queued uploads keep their files until they are sent (inside output_dir: hard links need one filesystem).
STAGING = ".hub-upload"
CARD = "README.md"
CONFIG_IN_REPO = "simpletuner_config.json"
#: The adapter files a checkpoint holds beside its training state (what ``spec.save_adapter`` writes).
ADAPTER_FILES = re.compile(r"^pytorch_lora_weights.*\.safetensors$")
_VALIDATION_PNG = re.compile(r"^step_(\d{6})(_\d+x\d+)?_(\d+)(_ema)?\.png$")
#: Seconds between the attempts of a failed upload (three attempts, as SimpleTuner makes).
RETRY_DELAYS = (10.0, 60.0)

Content = Path | bytes


@dataclass(frozen=True)
class UploadJob:
    """One commit: the files (a local file or bytes, and its path in the repo), the commit message, what to
    call it in the log, and the shell command that uploads the same by hand."""

    what: str
    files: tuple[tuple[Content, str], ...]
    message: str
    manual: str


@dataclass
class _Queued:
    job: UploadJob
    folder: Path  # its staging folder
    done: threading.Event = field(default_factory=threading.Event)


class Publisher:
    """The uploads of one process (rank 0), one commit at a time in the order submitted.

    ``background``: :meth:`submit` returns at once; else it waits for that upload (SimpleTuner's
    ``push_to_hub_background: false``). :meth:`finish` waits for every upload queued. ``api``: an object with
    huggingface_hub's ``create_commit`` (tests pass the real ``HfApi`` pointed at a local server)."""

    def __init__(
        self,
        target: UploadTarget,
        staging: Path,
        *,
        background: bool = True,
        delays: Sequence[float] | None = None,
        api: Any = None,
        quiet: bool = True,
    ) -> None:
        from huggingface_hub import HfApi

        self.target, self.staging, self.background = target, staging, background
        self.delays = tuple(RETRY_DELAYS if delays is None else delays)
        self.api = api if api is not None else HfApi(endpoint=target.endpoint, token=target.token)
        self.quiet = quiet  # no per-file progress bars of the client (they would cut through the training bar)
        self.uploaded: list[tuple[UploadJob, str]] = []  # (job, commit URL)
        self.failed: list[UploadJob] = []
        self._queue: queue.Queue[_Queued | None] = queue.Queue()
        self._stop = threading.Event()
        self._count = 0
        self._thread: threading.Thread | None = None

    def submit(self, job: UploadJob) -> None:
        """Stage ``job``'s files and queue it (with ``background`` false: and wait until it is sent or failed)."""
        self._count += 1
        folder = self.staging / f"{self._count:04d}"
        try:
            staged = _stage(job, folder)
        except OSError as exc:  # a full disk, a removed file: the upload cannot be made, training goes on
            shutil.rmtree(folder, ignore_errors=True)
            self._report_failure(job, f"its files could not be set aside for the upload ({exc})")
            return
        item = _Queued(staged, folder)
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="hub-upload", daemon=True)
            self._thread.start()
        logger.info("Hub upload of %s to %s queued (%d file(s))", job.what, self.target.url, len(job.files))
        self._queue.put(item)
        if not self.background:
            item.done.wait()

    def finish(self) -> bool:
        """Wait for every queued upload; True when all were sent. Logs what is still being waited for."""
        if self._thread is None:
            return not self.failed
        if pending := self._queue.unfinished_tasks:
            logger.info("waiting for %d Hub upload(s) to %s to finish", pending, self.target.url)
        self._queue.join()
        self._queue.put(None)
        self._thread.join()
        self._thread = None
        shutil.rmtree(self.staging, ignore_errors=True)
        if self.staging.parent.name == STAGING:  # the shared folder goes with its last user
            with contextlib.suppress(OSError):
                self.staging.parent.rmdir()
        return not self.failed

    def abandon(self) -> list[UploadJob]:
        """Stop at once (the run is stopping): the uploads not yet sent are reported with their manual commands
        and returned; one being sent is cut off between attempts."""
        self._stop.set()
        left: list[UploadJob] = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                left.append(item.job)
                item.done.set()
            self._queue.task_done()
        for job in left:
            logger.warning("Hub upload of %s not sent (the run stopped): upload it by hand: %s", job.what, job.manual)
        return left

    # --- the upload thread ---------------------------------------------------------------
    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            try:
                self._send(item.job)
            finally:
                shutil.rmtree(item.folder, ignore_errors=True)
                item.done.set()
                self._queue.task_done()

    def _send(self, job: UploadJob) -> None:
        """One commit with retries; never raises (the run must not fail for an upload)."""
        attempts = len(self.delays) + 1
        for attempt in range(1, attempts + 1):
            if self._stop.is_set():
                return
            started = time.perf_counter()
            try:
                url = self._commit(job)
            except Exception as exc:  # noqa: BLE001 - any failure of an upload is reported, never raised
                reason = first_line(exc)
                if attempt == attempts:
                    self._report_failure(job, f"{attempts} attempts failed; the last: {reason}")
                    return
                delay = self.delays[attempt - 1]
                logger.warning(
                    "Hub upload of %s failed (attempt %d of %d: %s); trying again in %.0f s",
                    job.what,
                    attempt,
                    attempts,
                    reason,
                    delay,
                )
                if self._stop.wait(delay):
                    return
                continue
            self.uploaded.append((job, url))
            logger.info(
                "uploaded %s to %s in %.1f s: %s", job.what, self.target.url, time.perf_counter() - started, url
            )
            return

    def _commit(self, job: UploadJob) -> str:
        from huggingface_hub import CommitOperationAdd
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

        operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path)) for path, name in job.files]
        was_disabled = are_progress_bars_disabled("huggingface_hub")
        if self.quiet:
            disable_progress_bars("huggingface_hub")
        try:
            info = self.api.create_commit(
                repo_id=self.target.repo_id, operations=operations, commit_message=job.message, repo_type="model"
            )
        finally:
            if self.quiet and not was_disabled:
                enable_progress_bars("huggingface_hub")
        return str(getattr(info, "commit_url", info))

    def _report_failure(self, job: UploadJob, why: str) -> None:
        self.failed.append(job)
        logger.error(
            "Hub upload of %s to %s failed: %s. Training is not affected; the files are in the output folder. "
            "Upload them by hand: %s",
            job.what,
            self.target.url,
            why,
            job.manual,
        )


def _stage(job: UploadJob, folder: Path) -> UploadJob:
    """``job`` with every file hard-linked (else copied) and every bytes content written under ``folder``."""
    files: list[tuple[Content, str]] = []
    for content, name in job.files:
        staged = folder / name
        staged.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            staged.write_bytes(content)
        else:
            try:
                os.link(content, staged)
            except OSError:  # another filesystem, or links not allowed: a copy
                shutil.copy2(content, staged)
        files.append((staged, name))
    return UploadJob(job.what, tuple(files), job.message, job.manual)


def remove_staging(output_dir: Path) -> None:
    """Remove the staged files of uploads a killed run or command never sent (for the run that holds output_dir)."""
    shutil.rmtree(Path(output_dir) / STAGING, ignore_errors=True)


# --- what an upload holds ---------------------------------------------------------------------
@dataclass(frozen=True)
class RunFacts:
    """What the card and the commit message need besides the config: the base model's Hub id (None: a local
    folder), the processes the run trained with, and the output folder."""

    output_dir: Path
    base_model: str | None
    num_processes: int = 1


def final_job(config, facts: RunFacts, repo_id: str, write_card: bool = True) -> UploadJob:
    """The upload of a finished run: its final weights, card, config, EMA weights and last validation images.
    The card is also written to ``output_dir/README.md`` (``write_card``).

    Raises:
        ValueError: ``output_dir`` holds no final weights (the run did not finish).
    """
    out = facts.output_dir
    step, names = read_final_record(out)
    weights = [(path, path.relative_to(out).as_posix()) for name in names for path in _files_of(out / name)]
    ema = [(p, p.relative_to(out).as_posix()) for p in _files_of(out / EMA_FOLDER) if p.suffix == ".safetensors"]
    images, grid = validation_media(out / "validation", config, step)
    media = [(path, f"assets/{path.name}") for path, _ in images] + ([(grid, f"assets/{grid.name}")] if grid else [])
    card = _card(config, facts, repo_id, step, tuple(name for _, name in weights), (images, grid), ema)
    if write_card:
        write_atomic(out / CARD, card)
    files: list[tuple[Content, str]] = [*weights, *ema, *media, (card, CARD)]
    if (out / "config.json").is_file():
        files.append((out / "config.json", CONFIG_IN_REPO))
    message = f"{_kind(config)} after {step} steps, trained with simpletuner"
    return UploadJob("the final weights", tuple(files), message, manual_command(out, repo_id))


def checkpoint_job(config, facts: RunFacts, repo_id: str, checkpoint: Path, step: int) -> UploadJob:
    """The upload of ``checkpoint`` (``checkpoint-N``): a LoRA's adapter and its card to ``checkpoint-N/`` and to
    the repo's root (the root then holds the newest weights, as SimpleTuner leaves it); a full fine-tune's
    checkpoint folder (resumable state, not a diffusers folder) to ``checkpoint-N/`` only."""
    sub = checkpoint.name
    images, grid = validation_media(facts.output_dir / "validation", config, step, exact=True)
    adapters = sorted(p for p in checkpoint.iterdir() if ADAPTER_FILES.match(p.name))
    if not adapters:  # a full fine-tune: the checkpoint as saved
        state = tuple((p, f"{sub}/{p.relative_to(checkpoint).as_posix()}") for p in _files_of(checkpoint))
        message = f"{sub}: resumable full fine-tune state after {step} steps"
        return UploadJob(sub, state, message, manual_command(facts.output_dir, repo_id, step))
    files: list[tuple[Content, str]] = []
    for prefix in (f"{sub}/", ""):
        card = _card(
            config, facts, repo_id, step, tuple(p.name for p in adapters), (images, grid), checkpoint=bool(prefix)
        )
        files += [(p, prefix + p.name) for p in adapters]
        files += [(path, f"{prefix}assets/{path.name}") for path, _ in images]
        files += [(grid, f"{prefix}assets/{grid.name}")] if grid else []
        files.append((card, prefix + CARD))
    message = f"{sub}: {_kind(config)} after {step} steps, trained with simpletuner"
    return UploadJob(sub, tuple(files), message, manual_command(facts.output_dir, repo_id, step))


def _card(
    config,
    facts: RunFacts,
    repo_id: str,
    step: int,
    weights: tuple[str, ...],
    validation: tuple[list[tuple[Path, str]], Path | None],
    ema: Sequence[tuple[Path, str]] = (),
    checkpoint: bool = False,
) -> bytes:
    """The model card of an upload whose ``validation`` images and grid go to ``assets/`` beside it."""
    images, grid = validation
    facts_of_card = CardFacts(
        repo_id=repo_id,
        base_model=facts.base_model,
        step=step,
        num_processes=facts.num_processes,
        weight_files=weights,
        images=tuple((f"assets/{path.name}", prompt) for path, prompt in images),
        grid=f"assets/{grid.name}" if grid else None,
        ema_files=tuple(name for _, name in ema),
        checkpoint=checkpoint,
    )
    return model_card(config, facts_of_card).encode()


def read_final_record(output_dir: Path) -> tuple[int, list[str]]:
    """The step and the top-level names of the final weights ``output_dir/final_weights.json`` records.

    Raises:
        ValueError: there is no record (the run did not finish, or saved before records were kept).
    """
    path = Path(output_dir) / FINAL_RECORD
    try:
        record = orjson.loads(path.read_bytes())
        step, names = int(record["step"]), [str(n) for n in record["files"]]
    except FileNotFoundError:
        raise ValueError(
            f"{output_dir} holds no final weights ({FINAL_RECORD} is missing): the run has not finished there; "
            "finish it (resume_from_checkpoint: latest), or upload a checkpoint folder with `hf upload`"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} cannot be read ({first_line(exc)}): the final save did not complete") from None
    return step, names


def validation_media(
    folder: Path, config, step: int, exact: bool = False
) -> tuple[list[tuple[Path, str]], Path | None]:
    """The PNGs of the newest validation step at or before ``step`` (``exact``: at ``step`` only) with the
    prompt each shows (``step_NNNNNN[_WxH]_K[_ema].png``: image K of a size is prompt K // num_validation_images),
    and that step's grid (the first size's)."""
    found: dict[int, list[tuple[Path, re.Match[str]]]] = {}
    if folder.is_dir():
        for path in folder.iterdir():
            match = _VALIDATION_PNG.match(path.name)
            if match and int(match.group(1)) <= step:
                found.setdefault(int(match.group(1)), []).append((path, match))
    wanted = step if exact else max(found, default=None)
    if wanted is None or wanted not in found:
        return [], None
    prompts, per_prompt = config.validation_prompt_list, max(config.num_validation_images, 1)
    images = []
    for path, match in sorted(found[wanted], key=lambda pm: (pm[1].group(2) or "", int(pm[1].group(3)), pm[0].name)):
        index = int(match.group(3)) // per_prompt
        images.append((path, prompts[index] if index < len(prompts) else ""))
    grids = sorted(folder.glob(f"step_{wanted:06d}*_grid.png"))
    return images, grids[0] if grids else None


def manual_command(output_dir: Path, repo_id: str, checkpoint: int | None = None) -> str:
    """The command that makes the same upload by hand: ``simpletuner push`` (with ``--checkpoint N`` for one)."""
    return f"simpletuner push {output_dir} --repo {repo_id}" + (f" --checkpoint {checkpoint}" if checkpoint else "")


def _files_of(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []


def _kind(config) -> str:
    if config.training_type != "lora":
        return "full fine-tune"
    return "LyCORIS adapter" if config.lora_type == "lycoris" else "LoRA"


class RunUploads:
    """The uploads of a training run (rank 0, ``push_to_hub``): each checkpoint's when ``push_checkpoints_to_hub``
    (in the background unless ``push_to_hub_background`` is false), then the final weights, waited for."""

    def __init__(self, config, facts: RunFacts, target: UploadTarget) -> None:
        self.config, self.facts, self.target = config, facts, target
        staging = facts.output_dir / STAGING / "run"
        self.publisher = Publisher(target, staging, background=config.push_to_hub_background)

    @classmethod
    def start(cls, config, output_dir: Path, hub_model: str | None, num_processes: int, target=None):
        """The run's uploads, or None without ``push_to_hub``. ``target``: the repo the pre-flight checked
        (``simpletuner train`` checks it before anything is written); else it is checked here.

        Raises:
            HubError: no token, a read-only one, no network, a repo that cannot be written.
        """
        if not config.push_to_hub:
            return None
        if target is None:
            from simpletuner.hub import check_upload_access

            target = check_upload_access(config.hub_repo_id, config.model_card_private)
        base = hub_model.split("@", 1)[0] if hub_model else None
        return cls(config, RunFacts(Path(output_dir), base, num_processes), target)

    def checkpoint(self, path: Path, step: int) -> None:
        """Queue ``checkpoint-N``'s upload (``push_checkpoints_to_hub``)."""
        if self.config.push_checkpoints_to_hub:
            self.publisher.submit(checkpoint_job(self.config, self.facts, self.target.repo_id, path, step))

    def final(self) -> bool:
        """Upload the final weights, card, config and last validation images; wait for every upload. True when
        all were sent (a failure is logged with the command that uploads it by hand)."""
        self.publisher.submit(final_job(self.config, self.facts, self.target.repo_id))
        return self.publisher.finish()

    def abandon(self) -> None:
        """The run stops early: what was not sent is named with its manual command."""
        self.publisher.abandon()
