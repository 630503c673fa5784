"""Models named by a Hugging Face Hub id (``org/name``), resolved to a snapshot folder of the local Hub cache.

:func:`resolve_model` asks ``huggingface_hub.snapshot_download`` for the files a run needs: first the pipeline's
configs only (``model_index.json``, each component's JSON and tokenizer files: what the config check and the
estimator read), then, for training, the weights of the components the family loads (safetensors only; no
pickle formats, no fp16/bf16 variants, no single-file checkpoints at the repo's root). The settings are read
from the environment at the call, as the user set them for this run: ``HF_HUB_OFFLINE`` (use the cache only),
``HF_ENDPOINT``, ``HF_HUB_CACHE`` / ``HF_HOME`` (where the cache is), ``HF_TOKEN`` (read by the client).
Every failure is one :class:`HubError` line naming the repo and the fix. documentation/QUICKSTART.md, "Models
from the Hub".
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simpletuner.configuration.model_folder import looks_like_hub_id
from simpletuner.exit_codes import first_line

#: What the config check, family detection and the estimator read: configs and tokenizer files, never weights.
CONFIG_PATTERNS = ("model_index.json", "*/*.json", "*/*.txt", "*/*.model", "*/*.tiktoken")
#: Weight files a run never loads: pickle formats, other frameworks, precision variants (loads pass no variant).
IGNORED_WEIGHTS = (
    "*.bin",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.msgpack",
    "*.h5",
    "*.onnx",
    "*.onnx_data",
    "*.gguf",
    "*.fp16.safetensors",
    "*.bf16.safetensors",
    "*.fp16.safetensors.index.json",
    "*.bf16.safetensors.index.json",
)
_TRUE = ("1", "on", "yes", "true")
#: The weights diffusers' ``from_pretrained(use_safetensors=True)`` reads from one component's folder: one file, or
#: an index and its shards (no precision variants: IGNORED_WEIGHTS; no single-file checkpoints beside them).
DIFFUSERS_WEIGHTS = (
    "diffusion_pytorch_model.safetensors",
    "diffusion_pytorch_model.safetensors.index.json",
    "diffusion_pytorch_model-*.safetensors",
)
VAE_KEY = "pretrained_vae_model_name_or_path"
#: The key naming a ControlNet to train on (``controlnet: true``).
CONTROLNET_KEY = "controlnet_model_name_or_path"
_COMMIT = re.compile(r"[0-9a-f]{40}")


class HubError(ValueError):
    """A hub model that cannot be had: the message names the repo and what to do."""


@dataclass(frozen=True)
class HubSnapshot:
    """A resolved hub model: the repo, the revision asked for (None: the default branch), the commit it
    resolved to, and the snapshot folder in the Hub cache."""

    repo_id: str
    revision: str | None
    commit: str
    folder: Path

    def describe(self) -> str:
        """``org/name@main (commit 0123abcd…) in /cache/…/snapshots/…``."""
        return f"{self.repo_id}@{self.revision or 'main'} (commit {self.commit[:12]}) in {self.folder}"


def is_hub_model(value: Any) -> bool:
    """``value`` is an ``org/name`` hub id and not a path on this machine."""
    return isinstance(value, str) and looks_like_hub_id(value) and not os.path.exists(os.path.expanduser(value))


def hub_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """The Hub cache ``huggingface_hub`` uses under these settings: ``HF_HUB_CACHE``, else ``HF_HOME/hub``."""
    if environ.get("HF_HUB_CACHE"):
        return Path(environ["HF_HUB_CACHE"]).expanduser()
    home = environ.get("HF_HOME") or os.path.join(environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def hub_endpoint(environ: Mapping[str, str] = os.environ) -> str:
    """The Hub the client talks to under these settings: ``HF_ENDPOINT``, else huggingface.co."""
    return (environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def is_offline(environ: Mapping[str, str] = os.environ) -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set to a true value: the cache only, no requests."""
    value = environ.get("HF_HUB_OFFLINE") or environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in _TRUE


def resolve_config_model(raw: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> HubSnapshot | None:
    """Where a raw config's ``pretrained_model_name_or_path`` is a hub id: its configs in the Hub cache (no
    weights), at the config's ``revision``; None for a local path.

    Raises:
        HubError: as :func:`resolve_model`.
    """
    model, revision = raw.get("pretrained_model_name_or_path"), raw.get("revision")
    if not isinstance(model, str) or not is_hub_model(model):
        return None
    return resolve_model(model, revision if isinstance(revision, str) else None, environ=environ)


def resolve_config_vae(raw: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> HubSnapshot | None:
    """Where a raw config's ``pretrained_vae_model_name_or_path`` is a hub id: its VAE config in the Hub cache (no
    weights) at the repo's default branch; None when unset or a local path.

    Raises:
        HubError: as :func:`resolve_vae`.
    """
    vae = raw.get(VAE_KEY)
    if not isinstance(vae, str) or not is_hub_model(vae):
        return None
    return resolve_vae(vae, environ=environ)


def resolve_config_controlnet(raw: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> HubSnapshot | None:
    """Where a raw config's ``controlnet_model_name_or_path`` is a hub id: its config in the Hub cache (no weights)
    at the repo's default branch; None when unset or a local path.

    Raises:
        HubError: as :func:`resolve_controlnet`.
    """
    controlnet = raw.get(CONTROLNET_KEY)
    if not isinstance(controlnet, str) or not is_hub_model(controlnet):
        return None
    return resolve_controlnet(controlnet, environ=environ)


def resolve_vae(
    repo_id: str, revision: str | None = None, weights: bool = False, environ: Mapping[str, str] = os.environ
) -> HubSnapshot:
    """The snapshot folder of the VAE repo ``repo_id`` (``pretrained_vae_model_name_or_path``) at ``revision`` (None:
    the default branch) with its VAE config: ``vae/config.json`` of a pipeline repo, else the root ``config.json`` of
    a component repo (``madebyollin/sdxl-vae-fp16-fix``); with ``weights``, that folder's diffusers safetensors
    (:data:`DIFFUSERS_WEIGHTS`, not IGNORED_WEIGHTS: none of the repo's single-file checkpoints, pickles or
    precision variants). Downloads what the cache lacks unless offline.

    Raises:
        HubError: as :func:`resolve_model`; a repo with neither config, or (``weights``) without safetensors weights.
    """
    fix = f"set {VAE_KEY} to the diffusers version of the VAE, or remove it to use the model's own VAE"
    return _resolve_component(repo_id, revision, weights, environ, VAE_KEY, ("vae/", ""), "VAE", fix)


def resolve_controlnet(
    repo_id: str, revision: str | None = None, weights: bool = False, environ: Mapping[str, str] = os.environ
) -> HubSnapshot:
    """As :func:`resolve_vae`, for the ControlNet repo ``controlnet_model_name_or_path`` names: its root
    ``config.json`` (a ControlNet repo, as SimpleTuner's ``from_pretrained(repo)`` reads it), else
    ``controlnet/config.json``."""
    fix = f"set {CONTROLNET_KEY} to a diffusers ControlNet repo or folder, or remove it to make one from the model"
    return _resolve_component(
        repo_id, revision, weights, environ, CONTROLNET_KEY, ("", "controlnet/"), "ControlNet", fix
    )


def _resolve_component(
    repo_id: str,
    revision: str | None,
    weights: bool,
    environ: Mapping[str, str],
    key: str,
    subfolders: tuple[str, ...],
    what: str,
    fix: str,
) -> HubSnapshot:
    """The snapshot of a one-component repo named by ``key``: the first of ``subfolders`` (``""``: the root) holding
    a ``config.json``, and with ``weights`` its diffusers safetensors."""
    configs = _download(repo_id, revision, [f"{sub}config.json" for sub in subfolders], None, environ, key=key)
    subfolder = next((sub for sub in subfolders if (configs.folder / sub / "config.json").is_file()), None)
    if subfolder is None:
        names = " or ".join(sorted(f"{sub}config.json" for sub in subfolders))
        raise HubError(
            f"{repo_id} has no {names} in {configs.folder}: it is not a diffusers {what} repo (a single-file "
            f"checkpoint?); {fix}"
        )
    if not weights:
        return configs
    allow = [subfolder + name for name in DIFFUSERS_WEIGHTS]
    found = _download(repo_id, configs.commit, allow, list(IGNORED_WEIGHTS), environ, key=key)
    folder = found.folder / subfolder if subfolder else found.folder
    if not any((folder / name).is_file() for name in DIFFUSERS_WEIGHTS[:2]):
        raise HubError(
            f"{repo_id}: the snapshot in {found.folder} has no diffusion_pytorch_model.safetensors in "
            f"{subfolder or 'its root'}{_why_no_weights(repo_id, environ, 'the repo holds none')}"
        )
    return HubSnapshot(repo_id, revision, found.commit, found.folder)


def snapshot_of(folder: str | os.PathLike[str]) -> tuple[str, str] | None:
    """``(repo_id, commit)`` of a Hub cache snapshot folder (``.../models--org--name/snapshots/<commit>``, as the
    client lays one out); None for any other folder. By the path's shape only (a repo id never holds ``--``)."""
    path = Path(folder)
    repo = path.parent.parent.name
    if path.parent.name != "snapshots" or not _COMMIT.fullmatch(path.name) or not repo.startswith("models--"):
        return None
    return "/".join(repo[len("models--") :].split("--")), path.name


def resolve_model(
    repo_id: str,
    revision: str | None = None,
    components: tuple[str, ...] | None = None,
    environ: Mapping[str, str] = os.environ,
) -> HubSnapshot:
    """The snapshot folder of ``repo_id`` at ``revision`` with its configs, and with ``components``' weights when
    given (those listed in the repo's ``model_index.json``); downloads what the cache lacks unless offline.

    Raises:
        HubError: the repo does not exist or is gated / private without a token, the revision does not
            exist, the Hub cannot be reached or offline mode is on and the cache lacks the files, or the repo
            is not a diffusers pipeline.
    """
    configs = _download(repo_id, revision, list(CONFIG_PATTERNS), None, environ)
    index = _read_index(configs, repo_id)
    if components is None:
        return configs
    wanted = [c for c in components if isinstance(index.get(c), list) and index[c][0] is not None]
    weights = _download(repo_id, configs.commit, [f"{c}/*" for c in wanted], list(IGNORED_WEIGHTS), environ)
    missing = [c for c in wanted if _loads_weights(index[c]) and not _has_safetensors(weights.folder / c)]
    if missing:
        raise HubError(
            f"{repo_id}: the snapshot in {weights.folder} has no .safetensors weights for {', '.join(missing)}"
            + _why_no_weights(repo_id, environ, "the repo holds none for them")
        )
    return HubSnapshot(repo_id, revision, weights.commit, weights.folder)


def _why_no_weights(repo_id: str, environ: Mapping[str, str], online: str) -> str:
    """The end of a "no .safetensors weights" line: offline, the cache holds part of the repo; else ``online``."""
    if is_offline(environ):
        return (
            " (offline: the Hub cache holds only part of the repo; on a machine with network run "
            f"`hf download {repo_id}`, or unset HF_HUB_OFFLINE)"
        )
    return f" ({online}: simpletuner loads safetensors only)"


def _loads_weights(entry: list) -> bool:
    """A model_index.json entry of a component with weights (not a tokenizer, scheduler or processor)."""
    name = str(entry[1] or "")
    return not any(word in name for word in ("Tokenizer", "Scheduler", "Processor", "FeatureExtractor"))


def _has_safetensors(folder: Path) -> bool:
    return folder.is_dir() and any(p.name.endswith(".safetensors") for p in folder.iterdir())


def _read_index(snapshot: HubSnapshot, repo_id: str) -> dict[str, Any]:
    import orjson

    path = snapshot.folder / "model_index.json"
    try:
        index = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        raise HubError(
            f"{repo_id} has no model_index.json in {snapshot.folder}: it is not a diffusers pipeline repo (a "
            "single-file checkpoint or a component repo); name the diffusers version of the model"
        ) from None
    except (OSError, ValueError) as exc:
        raise HubError(f"{repo_id}: {path} cannot be read ({exc})") from None
    if not isinstance(index, dict):
        raise HubError(f"{repo_id}: {path} is not a JSON object")
    return index


def _download(
    repo_id: str,
    revision: str | None,
    allow: list[str],
    ignore: list[str] | None,
    environ: Mapping[str, str],
    key: str = "pretrained_model_name_or_path",
) -> HubSnapshot:
    """One ``snapshot_download`` with the settings of ``environ``, its errors turned into :class:`HubError` (naming
    the config ``key`` that could point at a local folder instead)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = is_offline(environ)
    endpoint = hub_endpoint(environ)
    cache = hub_cache_dir(environ)
    where = f"the Hub at {endpoint}"
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=str(cache),
            allow_patterns=allow,
            ignore_patterns=ignore,
            local_files_only=offline,
            endpoint=None if offline else endpoint,
        )
    except GatedRepoError:
        raise HubError(
            f"{repo_id} is gated on {where}: accept its terms on the model's page, then log in on this machine "
            "(`hf auth login`, or set HF_TOKEN to a token of that account)"
        ) from None
    except RepositoryNotFoundError:
        raise HubError(
            f"{repo_id}: no such model repo on {where}, or it is private and no token with access is set: check the "
            "id (org/name, as on the model's page), or log in (`hf auth login` / HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise HubError(
            f"{repo_id}: revision {revision!r} does not exist on {where}: set `revision` to a branch, tag or commit "
            "of the repo, or leave it out for the default branch"
        ) from None
    except LocalEntryNotFoundError:
        if offline:
            raise HubError(
                f"{repo_id}{'@' + revision if revision else ''} is not in the Hub cache {cache} and HF_HUB_OFFLINE is "
                f"set: unset it to download, or fill the cache on a machine with network (`hf download "
                f"{repo_id}`, then copy {cache}), or point {key} at a local folder"
            ) from None
        raise HubError(
            f"{repo_id}: {where} cannot be reached and the Hub cache {cache} does not hold it: check the network "
            f"(and HF_ENDPOINT), or set {key} to a local folder of the {'VAE' if key == VAE_KEY else 'model'}"
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        raise HubError(
            f"{repo_id}: downloading from {where} failed ({first_line(exc)}); try again, or use a local folder"
        ) from None
    path = Path(folder)
    return HubSnapshot(repo_id, revision, path.name, path)


@dataclass(frozen=True)
class UploadTarget:
    """A model repo uploads may go to: its full id (``org/name``), the token that writes to it, the Hub's URL."""

    repo_id: str
    token: str
    endpoint: str

    @property
    def url(self) -> str:
        return f"{self.endpoint}/{self.repo_id}"


def check_upload_access(repo_id: str, private: bool, environ: Mapping[str, str] = os.environ) -> UploadTarget:
    """Make sure uploads to ``repo_id`` can work before any training: online, a token found (``HF_TOKEN`` or
    ``hf auth login``), valid and not read-only; then the repo is created when it does not exist (``private``
    then; one that exists keeps its visibility), as SimpleTuner does at start. ``repo_id`` without an ``org/``
    is put under the token's account. Returns the target with the full id.

    Raises:
        HubError: one line naming the repo and the fix.
    """
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError

    where = f"the Hub at {hub_endpoint(environ)}"
    if is_offline(environ):
        raise HubError(
            f"push_to_hub to {repo_id}: HF_HUB_OFFLINE is set, so nothing can be uploaded: unset it, or set "
            "push_to_hub false and upload the finished run later with `simpletuner push OUTPUT_DIR --repo "
            f"{repo_id}` from a machine with network"
        )
    token = get_token()
    if not token:
        raise HubError(
            f"push_to_hub to {repo_id}: no Hugging Face token on this machine: log in with `hf auth login` (a token "
            "with write access), or set HF_TOKEN; or set push_to_hub false"
        )
    api = HfApi(endpoint=hub_endpoint(environ), token=token)
    try:
        me = api.whoami()
        role = ((me.get("auth") or {}).get("accessToken") or {}).get("role")
        if role == "read":
            raise HubError(
                f"push_to_hub to {repo_id}: the token on this machine is read-only: make a token with write access "
                "(huggingface.co/settings/tokens) and log in with it (`hf auth login`, or HF_TOKEN)"
            )
        full_id = repo_id if "/" in repo_id else f"{me['name']}/{repo_id}"
        api.create_repo(full_id, private=private, exist_ok=True, repo_type="model")
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status == 401:
            raise HubError(
                f"push_to_hub to {repo_id}: {where} does not accept the token on this machine (expired or revoked?): "
                "log in again with `hf auth login`, or set HF_TOKEN to a valid write token"
            ) from None
        if status == 403:
            raise HubError(
                f"push_to_hub to {repo_id}: the token on this machine may not create or write that repo on {where} "
                "(another account's or an organization you cannot write to): set hub_model_id to a repo of your "
                "account, or use a token with write access to it"
            ) from None
        raise HubError(f"push_to_hub to {repo_id}: {where} answered {first_line(exc)}: try again later") from None
    except HubError:
        raise
    except Exception as exc:  # noqa: BLE001 - no connection, a timeout: the transport's errors differ by client version
        raise HubError(
            f"push_to_hub to {repo_id}: {where} cannot be reached ({type(exc).__name__}: {first_line(exc)}): check "
            "the network and HF_ENDPOINT, or set push_to_hub false and upload later with `simpletuner push`"
        ) from None
    return UploadTarget(full_id, token, hub_endpoint(environ))
