"""Where weights come from: a local path, or the Hugging Face hub only when asked for.

A name that exists on disk is a path, whatever it looks like. A name that does not exist is a
hub repository only when the user says so -- ``hf:owner/name`` -- or when it is one of the
published ids the README names (``mispeech/ced-{tiny,mini,small,base}``,
``cointegrated/SONAR_200_text_encoder``). Anything else fails at once with an error naming the
path and the ``hf:`` form, instead of minutes of network retries for a mistyped folder.
``HF_HUB_OFFLINE=1`` is honoured: the hub's local cache is read and no connection is tried.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The explicit form of a hub repository: ``hf:mispeech/ced-base``.
HUB_PREFIX = "hf:"

#: Published repositories that are taken as hub ids without the prefix (when no such local
#: path exists), so the README's ids keep working.
KNOWN_HUB_IDS = frozenset(
    {f"mispeech/ced-{size}" for size in ("tiny", "mini", "small", "base")}
    | {"cointegrated/SONAR_200_text_encoder"}
)


@dataclass(frozen=True)
class HubRepo:
    """A Hugging Face hub repository the user asked for."""

    repo_id: str

    def __str__(self) -> str:
        return f"{HUB_PREFIX}{self.repo_id}"


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` set to a true value (huggingface_hub's own reading of it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def locate(name: str | os.PathLike[str], what: str) -> Path | HubRepo:
    """``name`` as a local :class:`~pathlib.Path` (it exists) or a :class:`HubRepo` (asked for);
    ``what`` names the option or argument in the error (``--ced-checkpoint``)."""
    text = os.fspath(name)
    if text.startswith(HUB_PREFIX):
        repo = text[len(HUB_PREFIX) :].strip("/")
        parts = repo.split("/")
        if not repo or len(parts) > 2 or any(not p or p in (".", "..") for p in parts):
            raise ValueError(f"{what} {text}: expected hf:owner/name (a hub repository id)")
        return HubRepo(repo)
    path = Path(text).expanduser()
    if path.exists():
        return path
    if text in KNOWN_HUB_IDS:
        return HubRepo(text)
    raise FileNotFoundError(
        f"{what} {text}: no such file or directory ({path.resolve()}); to download a "
        f"Hugging Face hub repository write it as {HUB_PREFIX}owner/name "
        f"(e.g. {HUB_PREFIX}mispeech/ced-base)"
    )


def _hub_error(what: str, repo: HubRepo, err: Exception) -> Exception:
    if hub_offline():
        return FileNotFoundError(
            f"{what} {repo}: HF_HUB_OFFLINE=1 and the hub cache holds no copy; download it "
            f"once with network (hf download {repo.repo_id} --local-dir DIR, then pass DIR) "
            f"or unset HF_HUB_OFFLINE ({type(err).__name__}: {err})"
        )
    return OSError(f"{what} {repo}: could not download from the hub ({type(err).__name__}: {err})")


def hub_file(repo: HubRepo, filename: str, what: str) -> Path:
    """One file of a hub repository (from the cache only under ``HF_HUB_OFFLINE=1``)."""
    hf_hub_download = _hub_api("hf_hub_download", what)
    try:
        return Path(hf_hub_download(repo.repo_id, filename, local_files_only=hub_offline()))
    except Exception as err:  # huggingface_hub's errors: not found, offline, network, ...
        raise _hub_error(what, repo, err) from err


def hub_snapshot(repo: HubRepo, what: str) -> Path:
    """A hub repository's files (from the cache only under ``HF_HUB_OFFLINE=1``)."""
    snapshot_download = _hub_api("snapshot_download", what)
    try:
        return Path(snapshot_download(repo.repo_id, local_files_only=hub_offline()))
    except Exception as err:
        raise _hub_error(what, repo, err) from err


def _hub_api(name: str, what: str) -> Any:
    try:
        import huggingface_hub
    except ImportError as err:  # pragma: no cover - huggingface_hub comes with transformers
        raise ImportError(
            f"{what}: loading from the hub needs huggingface_hub "
            "(pip install 'contrastive-losses[examples]')"
        ) from err
    return getattr(huggingface_hub, name)
