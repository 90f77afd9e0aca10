"""hub: model specs that name a Hugging Face repo, resolved in the local Hugging Face cache.

- repo spec: `org/name` or `org/name@revision`; the revision is a branch, a tag or a
  40-hex commit hash, `main` when absent.
- cache: huggingface_hub's model cache — `HF_HUB_CACHE`, else `$HF_HOME/hub`, else
  `~/.cache/huggingface/hub`, read when huggingface_hub is first imported — or the
  `cache_dir` a caller passes.
- repo folder: `<cache>/models--org--name`; a branch or tag resolves through its
  `refs/<revision>` file to a commit, and the commit to `snapshots/<commit>/`, the
  snapshot: a model directory like any other (its files link into `blobs/`).

Never a download: huggingface_hub is asked with `local_files_only=True`, which makes it
read the cache and nothing else, whatever `HF_HUB_OFFLINE` says. A repo that is not
there is a ModelNotCached naming the repo id, the revision and the folder it looked in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id
from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

from engine.models.errors import ModelNotCached

DEFAULT_REVISION = "main"
_SPEC = re.compile(r"(?P<repo>[^/@\s]+/[^/@\s]+)(?:@(?P<revision>[^@\s]+))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class RepoSpec:
    repo_id: str  # "org/name"
    revision: str | None  # None: the default branch

    @classmethod
    def parse(cls, spec: str) -> RepoSpec | None:
        """The repo spec `spec` spells, or None when it is not one."""
        m = _SPEC.fullmatch(spec)
        if m is None:
            return None
        repo, revision = m["repo"], m["revision"]
        try:
            validate_repo_id(repo)
        except HFValidationError:
            return None
        # A revision names a ref file under the repo folder: no way out of it.
        if revision is not None and any(part in ("", ".", "..") for part in revision.split("/")):
            return None
        return cls(repo, revision)

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def default_cache_dir() -> Path:
    return Path(constants.HF_HUB_CACHE).expanduser()


def repo_folder(repo: RepoSpec, cache_dir: Path) -> Path:
    return cache_dir / constants.REPO_ID_SEPARATOR.join(["models", *repo.repo_id.split("/")])


def resolve(repo: RepoSpec, *, cache_dir: str | Path | None = None) -> Path:
    """The snapshot folder of `repo` in the local cache; ModelNotCached when it has none."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    revision = repo.revision or DEFAULT_REVISION
    try:
        path = snapshot_download(
            repo.repo_id,
            revision=revision,
            cache_dir=cache,
            local_files_only=True,
            # mlx-lm's own patterns: a snapshot it downloaded counts as complete.
            allow_patterns=DEFAULT_ALLOW_PATTERNS,
        )
    except LocalEntryNotFoundError as e:
        folder = repo_folder(repo, cache)
        raise ModelNotCached(
            str(repo),
            repo_id=repo.repo_id,
            revision=revision,
            folder=folder,
            why=_why(folder, revision, e),
        ) from e
    return Path(path)


def _why(folder: Path, revision: str, error: LocalEntryNotFoundError) -> str:
    """What is missing, in the cache's own terms."""
    if not folder.is_dir():
        return "no such repo folder"
    commit = revision
    if not _COMMIT.fullmatch(revision):
        ref = folder / "refs" / revision
        if not ref.is_file():
            known = sorted(p.name for p in (folder / "refs").glob("*") if p.is_file())
            return f"no ref {revision!r} (refs here: {', '.join(known) or 'none'})"
        commit = ref.read_text().strip()
    if not (folder / "snapshots" / commit).is_dir():
        return f"no snapshot {commit}"
    return f"snapshot {commit} is incomplete: {error}"
