"""The Hugging Face Hub side of `hf://` sources, through `huggingface_hub` itself (the
Hub's own client: mirrors set with an endpoint, private repositories with a token).

A revision is resolved to its commit once, and the files are fetched at that commit, so
a branch that moves during a download cannot mix two versions of a model."""

from __future__ import annotations

from pathlib import Path

from .base import (REPOSITORY_NOT_FOUND, REVISION_NOT_FOUND, UNAUTHORIZED, UNREACHABLE, Listing,
                          ModelFetchError, RemoteFile)
from .cache import is_whole, writing_whole
from .uri import FileSelection, HubSource

TIMEOUT_S = 30.0


def _where(endpoint: str | None) -> str:
    return endpoint or "https://huggingface.co"


def hub_error(exc: Exception, source: HubSource, endpoint: str | None, token: str | None) -> ModelFetchError:
    """One line naming the cause, for the errors a Hub (or mirror) gives."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                        RevisionNotFoundError)
    where = _where(endpoint)
    auth = "with the token given" if token else "without a token"
    if isinstance(exc, RevisionNotFoundError):
        return ModelFetchError(REVISION_NOT_FOUND, f"hf://{source.repo}: revision {source.revision!r} "
                                                   f"does not exist at {where}")
    if isinstance(exc, GatedRepoError):
        return ModelFetchError(UNAUTHORIZED, f"hf://{source.repo} is gated at {where}: the token must belong "
                                             "to an account that accepted its conditions")
    if isinstance(exc, RepositoryNotFoundError):
        # The Hub answers 401 or 404 for a private repository the token cannot read, too.
        return ModelFetchError(REPOSITORY_NOT_FOUND, f"hf://{source.repo}: no such repository at {where} "
                                                     f"(or it is private and cannot be read {auth})")
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status in (401, 403):
        return ModelFetchError(UNAUTHORIZED, f"hf://{source.repo}: {where} refused the request {auth} "
                                             f"(HTTP {status}); check the token")
    if isinstance(exc, HfHubHTTPError):
        return ModelFetchError(UNREACHABLE, f"hf://{source.repo}: {where} answered HTTP {status}")
    return ModelFetchError(UNREACHABLE, f"hf://{source.repo}: cannot reach {where}: "
                                        f"{type(exc).__name__}: {exc}".strip())


def _network_errors() -> tuple[type[BaseException], ...]:
    """What the Hub client raises for HTTP and transport failures: its own HTTP errors and
    those of the httpx it runs on (huggingface_hub 2.x uses httpx2)."""
    from huggingface_hub.errors import HfHubHTTPError
    errors: list[type[BaseException]] = [HfHubHTTPError, ConnectionError, TimeoutError]
    for module in ("httpx", "httpx2"):
        try:
            errors.append(__import__(module).HTTPError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def hub_listing(source: HubSource, selection: FileSelection, endpoint: str | None,
                token: str | None) -> Listing:
    """The commit the revision names now and the files to fetch at it (sizes, checksums).
    Sizes come from the tree listing: mirrors such as olah leave them out of model_info."""
    from huggingface_hub import HfApi
    api = HfApi(endpoint=endpoint, token=token or False)
    try:
        try:
            commit = api.model_info(source.repo, revision=source.revision, timeout=TIMEOUT_S).sha
        except _network_errors() as e:
            if _revision_missing(e, api, source):
                raise ModelFetchError(REVISION_NOT_FOUND, f"hf://{source.repo}: revision {source.revision!r} "
                                                          f"does not exist at {_where(endpoint)}") from None
            raise
        tree = [f for f in api.list_repo_tree(source.repo, revision=commit, recursive=True)
                if getattr(f, "size", None) is not None]  # files; folders have no size
    except _network_errors() as e:
        raise hub_error(e, source, endpoint, token) from None
    by_name = {f.path: f for f in tree}
    files = []
    for name in selection.select(list(by_name)):
        f = by_name[name]
        lfs = f.lfs
        files.append(RemoteFile(name, f.size, sha256=lfs.sha256 if lfs else None,
                                git_sha1=None if lfs else f.blob_id))
    refs = () if source.pinned else (source.revision,)
    return Listing(key=commit, files=tuple(files), refs=refs)


def _revision_missing(exc: Exception, api, source: HubSource) -> bool:
    """A mirror may answer a missing revision as a missing repository (olah: 401) or with a
    500: when the repository answers at main, the revision is what is missing."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError
    if isinstance(exc, RevisionNotFoundError):
        return True
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if source.revision == "main" or not (isinstance(exc, RepositoryNotFoundError) or (status or 0) >= 500):
        return False
    try:
        api.model_info(source.repo, revision="main", timeout=TIMEOUT_S)
    except Exception:
        return False
    return True


def hub_download(source: HubSource, listing: Listing, file: RemoteFile, partial: Path,
                 endpoint: str | None, token: str | None) -> None:
    """One file into partial/ at the listing's commit, with huggingface_hub's own HTTP
    download. It is written to NAME.incomplete and renamed when whole; a crash resumes
    from the bytes on disk (a Range request), which hf_hub_download itself no longer does
    across processes."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers
    dest = partial / file.name
    if is_whole(dest, file.size):
        return
    url = hf_hub_url(source.repo, file.name, revision=listing.key, endpoint=endpoint)
    try:
        with writing_whole(dest, file.size) as (out, have):
            http_get(url, out, resume_size=have, headers=build_hf_headers(token=token or False),
                     expected_size=file.size, displayed_filename=file.name, tqdm_class=_silent_bar())
    except _network_errors() as e:
        raise hub_error(e, source, endpoint, token) from None


def _silent_bar():
    """A tqdm that never draws: the fetch reports bytes on disk for the whole model, and a
    bar on stderr would become the log's last line the operator reads for progress."""
    from tqdm import tqdm

    class Silent(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent
