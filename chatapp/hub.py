"""Models from the Hugging Face Hub: `hf:ORG/REPO[:QUANT]` or `hf:ORG/REPO/FILE.gguf`, as llama.cpp's `-hf`.

`huggingface_hub` does the transfer (a dropped connection resumes where it broke off; a progress bar; `HF_ENDPOINT`
and `HF_TOKEN` honoured). We choose the file, refuse anything that is not a single GGUF, and check the finished file
against the sha256 the hub lists for it before it is used. Each pulled file lives under
`models/hf/ORG--REPO/` with a small record of where it came from, so `chatapp -m hf:...` finds it again offline.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from chatapp import paths
from chatapp.catalog import ModelError, ModelNotFound, record_verified, sha256_file, verify_file

PREFIX = "hf:"
DEFAULT_QUANT = "Q4_K_M"  # what llama.cpp's -hf picks when the spec names none
GGUF_MAGIC = b"GGUF"
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)  # llama.cpp's split files: not one model file


class HubError(ModelError):
    """The hub refused or failed a request, or offered a file that is not what it claims."""


@dataclass(frozen=True)
class HubSpec:
    """A parsed `hf:` spec: the repository and either a quantization tag or a file name (or neither)."""

    repo: str
    quant: str | None = None
    file: str | None = None

    @classmethod
    def parse(cls, spec: str) -> HubSpec:
        body = spec.removeprefix(PREFIX).strip()
        quant = file = None
        parts = body.split("/")
        if len(parts) > 2:  # ORG/REPO/path/to/FILE.gguf
            body, file = "/".join(parts[:2]), "/".join(parts[2:])
        elif ":" in body:
            body, quant = body.rsplit(":", 1)
        if not _REPO.match(body) or (quant is not None and not quant) or (file is not None and not file):
            raise ModelNotFound(f"'{spec}' is not a hub model: write hf:ORG/REPO[:QUANT] or hf:ORG/REPO/FILE.gguf")
        if file is not None and not file.lower().endswith(".gguf"):
            raise HubError(f"{file} is not a GGUF file (chatapp runs .gguf files only)")
        return cls(body, quant, file)

    @property
    def text(self) -> str:
        return PREFIX + self.repo + (f":{self.quant}" if self.quant else "") + (f"/{self.file}" if self.file else "")


@dataclass(frozen=True)
class HubFile:
    """One file of a repository as the hub lists it."""

    name: str
    size: int | None
    sha256: str | None  # from the hub's LFS metadata; None for files kept in git itself


def repo_dir(models_dir: Path, repo: str) -> Path:
    return models_dir / "hf" / repo.replace("/", "--")


def _record_path(model: Path) -> Path:
    return model.with_name(model.name + ".hub.json")


def _quant_matches(name: str, quant: str) -> bool:
    """Whether a file name carries the quantization tag as a whole word: Q4_K_M matches `x.Q4_K_M.gguf` and
    `x-q4_k_m.gguf`, not `x-Q4_K_M_L.gguf`."""
    stem = Path(name).name[: -len(".gguf")]
    return re.search(rf"(^|[^A-Za-z0-9]){re.escape(quant)}($|[^A-Za-z0-9_])", stem, re.IGNORECASE) is not None


def choose_file(spec: HubSpec, files: Sequence[HubFile]) -> HubFile:
    """The repository file the spec means, or a HubError that lists what the repository has."""
    ggufs = [f for f in files if f.name.lower().endswith(".gguf")]
    if spec.file is not None:
        for f in files:
            if f.name == spec.file:
                break
        else:
            listed = ", ".join(f.name for f in ggufs) or "no .gguf files"
            raise HubError(f"{spec.repo} has no file {spec.file} (it has: {listed})")
        chosen = f
    else:
        singles = [f for f in ggufs if not _SPLIT.search(f.name)]
        if not singles:
            raise HubError(f"{spec.repo} has no single-file .gguf model")
        quant = spec.quant or DEFAULT_QUANT
        matches = [f for f in singles if _quant_matches(f.name, quant)]
        if not matches and spec.quant is None and len(singles) == 1:
            matches = singles  # one model file and no tag asked for: that one
        if not matches:
            raise HubError(
                f"{spec.repo} has no {quant} file; name one with hf:{spec.repo}:QUANT or /FILE.gguf "
                f"(it has: {', '.join(f.name for f in singles)})"
            )
        chosen = min(matches, key=lambda f: (f.name.count("/"), f.name))  # the top-level one first
    if _SPLIT.search(chosen.name):
        raise HubError(f"{chosen.name} is one part of a split GGUF, which chatapp does not read")
    return chosen


def _hub_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises for a refused, failed or malformed exchange (its HTTP client's own errors
    included: a connection refused or timed out is not an OSError there)."""
    from huggingface_hub import errors

    try:
        import httpx2 as http_client  # what huggingface_hub 2.x runs on
    except ImportError:
        import httpx as http_client  # type: ignore[no-redef]  # the same role under 1.x

    return (errors.HfHubHTTPError, errors.LocalEntryNotFoundError, http_client.HTTPError, OSError, ValueError)


def list_files(repo: str, *, endpoint: str | None = None, token: str | None = None) -> tuple[str, list[HubFile]]:
    """(commit, files) of a model repository's main revision, with sizes and sha256s."""
    from huggingface_hub import HfApi, errors

    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(repo, files_metadata=True)
    except errors.RepositoryNotFoundError:
        raise HubError(f"no model repository {repo} on the hub (or it is private: set HF_TOKEN)") from None
    except errors.GatedRepoError:
        raise HubError(f"{repo} is gated: accept its terms on the hub and set HF_TOKEN") from None
    except _hub_errors() as e:
        raise HubError(f"cannot list {repo}: {_one_line(e)}") from None
    files = []
    for sibling in info.siblings or []:
        lfs = getattr(sibling, "lfs", None)
        sha = getattr(lfs, "sha256", None) if lfs is not None else None
        files.append(HubFile(sibling.rfilename, getattr(sibling, "size", None), sha))
    if not info.sha:
        raise HubError(f"the hub gave no revision for {repo}")
    return info.sha, files


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def find_local(spec: HubSpec, models_dir: Path | None = None) -> Path | None:
    """A file pulled earlier for this spec, still matching its recorded sha256; None when there is none."""
    folder = repo_dir(paths.models_dir() if models_dir is None else models_dir, spec.repo)
    candidates = []
    for record_file in sorted(folder.rglob("*.gguf.hub.json")) if folder.is_dir() else []:
        try:
            record = json.loads(record_file.read_text(encoding="utf-8"))
            name, sha, size = str(record["file"]), str(record["sha256"]), int(record["size"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        candidates.append((HubFile(name, size, sha), record_file))
    if not candidates:
        return None
    try:
        chosen = choose_file(spec, [f for f, _ in candidates])
    except HubError:
        return None
    model = folder / chosen.name
    if model.is_file() and verify_file(model, chosen.sha256 or "", chosen.size):
        return model
    return None


def pull(
    spec_text: str,
    *,
    models_dir: Path | None = None,
    force: bool = False,
    endpoint: str | None = None,
    token: str | None = None,
    progress_bars: bool = True,
) -> Path:
    """Download the GGUF an `hf:` spec names (resuming a partial download), check it, and return its path."""
    spec = HubSpec.parse(spec_text)
    models_dir = paths.models_dir() if models_dir is None else models_dir
    if not force and (found := find_local(spec, models_dir)) is not None:
        return found
    commit, files = list_files(spec.repo, endpoint=endpoint, token=token)
    chosen = choose_file(spec, files)
    if not chosen.sha256:
        raise HubError(f"the hub lists no sha256 for {spec.repo}/{chosen.name}, so it cannot be checked")
    folder = repo_dir(models_dir, spec.repo)
    target = folder / chosen.name
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HubError(f"cannot write to {folder}: {e.strerror or e}") from None

    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    # Each pull downloads to a temporary file of its own (resuming only within the pull); a killed pull's is
    # never reused, so clear it rather than let it fill the disk.
    for stale in folder.glob(".cache/huggingface/download/**/*.incomplete"):
        with contextlib.suppress(OSError):
            stale.unlink()

    if not progress_bars:
        disable_progress_bars()
    try:
        downloaded = Path(
            hf_hub_download(
                spec.repo, chosen.name, revision=commit, local_dir=folder, endpoint=endpoint, token=token,
                force_download=force,
            )  # fmt: skip
        )
    except _hub_errors() as e:
        raise HubError(f"downloading {spec.repo}/{chosen.name}: {_one_line(e)}") from None
    finally:
        if not progress_bars:
            enable_progress_bars()
    downloaded = downloaded if downloaded.is_file() else target
    try:
        if chosen.size is not None and downloaded.stat().st_size != chosen.size:
            raise HubError(f"{chosen.name}: {downloaded.stat().st_size} bytes, the hub says {chosen.size}")
        digest = sha256_file(downloaded)
        if digest != chosen.sha256:
            raise HubError(f"{chosen.name}: sha256 {digest} does not match the hub's {chosen.sha256}")
        if not _is_gguf(downloaded):
            raise HubError(f"{chosen.name} is not a GGUF file (it does not start with the GGUF magic)")
    except BaseException:
        with contextlib.suppress(OSError):
            downloaded.unlink()  # a file that failed its checks is never left to be used
        raise
    record = {"repo": spec.repo, "revision": commit, "file": chosen.name, "sha256": digest, "size": chosen.size}
    tmp = _record_path(downloaded).with_suffix(".tmp")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    os.replace(tmp, _record_path(downloaded))
    record_verified(downloaded, digest)
    return downloaded


def is_hub_spec(spec: str) -> bool:
    return spec.startswith(PREFIX)
