"""A real Hugging Face Hub-compatible server for the tests: olah serving local git repositories.

`HubServer({"org/name": Path(...)})` turns each directory into a git repository in the layout
olah (PyPI `olah`, a self-hosted Hub mirror) serves without any upstream, starts olah as a
subprocess in offline mode, and puts a small reverse proxy of this module in front of it.
Clients (huggingface_hub with `endpoint=server.endpoint`, or HF_ENDPOINT) talk the Hub
protocol to olah through that proxy.

How olah 0.5.4 serves local repositories (read from its source, olah/server_mirror.py and
olah/mirror/repos.py):
  * config: TOML `[basic] mirrors-path = [DIR, ...]` and `[accessibility] offline = true`
    (offline: olah never asks huggingface.co whether a repository is visible, nor resolves
    revisions there; the hf-netloc here is an unreachable loopback port all the same);
  * a model repository `org/name` is a NON-bare git repository at DIR/models/org/name;
    olah reads commits, branches and tags with GitPython, so any git ref (branch, tag, full
    commit sha) is a revision;
  * large files are git-LFS pointer files in the commit, with the content at
    .git/lfs/objects/<oid[0:2]>/<oid[2:4]>/<oid> of that repository (olah opens the object
    there itself, so no git-lfs binary is needed to build one).

Why there is a proxy in front of olah, and what it does:
  * bytes_served(): olah keeps no count of bytes served. The proxy counts the body bytes of
    file downloads (2xx answers to GET .../resolve/...), exactly as written to clients.
  * set_throttle(): olah has no rate limit; the proxy paces those same file bodies.
  * token: in offline mode olah checks no credentials at all (server_access.py:
    ensure_repo_visibility returns early when offline), so the proxy enforces
    `Authorization: Bearer <token>`, answering as the Hub does: no credentials -> 401 with
    X-Error-Code RepoNotFound (a private repository), wrong credentials -> 401 "Invalid
    credentials in Authorization header".
  * hub_compat (default on): olah's offline-mirror code answers a few requests unlike the
    Hub. The proxy corrects exactly these, using only the git repositories it built and olah's
    own answers; `hub_compat=False` shows olah's raw behaviour:
      - GET /api/models/org/name (no revision; `model_info(repo)`): olah offline looks only
        in its download cache and answers 401 RepoNotFound -> forwarded as .../revision/main;
      - an unknown branch/tag: olah answers 401 RepoNotFound, an unknown full commit sha: 500
        -> 404 RevisionNotFound ("Invalid rev id: ...", the answer olah gives when online);
      - a missing file under resolve/: olah answers 401 RepoNotFound -> 404 EntryNotFound;
      - `model_info(..., files_metadata=True)` (?blobs=true): olah ignores the parameter and
        lists siblings by name only -> each sibling gets size, blobId and lfs {sha256, size,
        pointerSize} from olah's own tree listing of the same commit.
Everything else (metadata JSON, refs, tree listings, HEAD headers x-repo-commit/etag/
content-length, file bytes) is olah's answer, passed through unchanged.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from fnmatch import fnmatch
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

START_DEADLINE_S = 60.0
STOP_DEADLINE_S = 15.0
CHUNK = 64 * 1024
LFS_MIN_SIZE = 10 * 1024 * 1024  # the Hub stores every file above 10 MB in LFS
# The patterns of the .gitattributes the Hub writes into a new model repository (abridged).
LFS_PATTERNS = ("*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.ftz", "*.gguf", "*.gz", "*.h5",
                "*.joblib", "*.mlmodel", "*.model", "*.msgpack", "*.npy", "*.npz", "*.onnx", "*.ot",
                "*.parquet", "*.pb", "*.pickle", "*.pkl", "*.pt", "*.pth", "*.rar", "*.safetensors",
                "*.tar", "*.tflite", "*.tgz", "*.wasm", "*.xz", "*.zip", "*.zst")
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
              "trailer", "trailers", "transfer-encoding", "upgrade"}
_GIT = ["git", "-c", "user.name=kvpilot tests", "-c", "user.email=tests@kvpilot.invalid",
        "-c", "commit.gpgsign=false", "-c", "tag.gpgsign=false", "-c", "core.autocrlf=false",
        "-c", "init.defaultBranch=main"]
_API = re.compile(r"^/api/models/(?P<org>[^/]+)/(?P<name>[^/]+)"
                  r"(?:/(?P<kind>revision|tree|paths-info|commits)/(?P<rev>[^/]+)(?P<rest>/.*)?)?$")
_RESOLVE = re.compile(r"^/(?:models/)?(?P<org>[^/]+)/(?P<name>[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
           "GIT_TERMINAL_PROMPT": "0"}
    return subprocess.run([*_GIT, "-C", str(repo), *args], check=True, capture_output=True,
                          text=True, env=env).stdout.strip()


def _is_lfs(rel: str, size: int) -> bool:
    return size > LFS_MIN_SIZE or any(fnmatch(Path(rel).name, p) for p in LFS_PATTERNS)


def build_mirror_repo(git_dir: Path, revisions: Sequence[Path]) -> None:
    """A git repository at git_dir in olah's mirror layout: one commit on main per directory
    in `revisions` (oldest first), commit i tagged v<i>; large/model files as LFS pointers
    with their objects under .git/lfs/objects; a Hub-style .gitattributes unless the
    directory has its own."""
    git_dir.mkdir(parents=True)
    _git(git_dir, "init", "-q", "-b", "main")
    for i, src in enumerate(revisions, 1):
        for child in git_dir.iterdir():
            if child.name != ".git":
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        for f in sorted(Path(src).rglob("*")):
            rel = f.relative_to(src).as_posix()
            if not f.is_file() or ".git" in f.relative_to(src).parts:
                continue
            dst = git_dir / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            size = f.stat().st_size
            if not _is_lfs(rel, size):
                shutil.copyfile(f, dst)
                continue
            digest = hashlib.sha256()
            with f.open("rb") as fh:
                while block := fh.read(1 << 20):
                    digest.update(block)
            oid = digest.hexdigest()
            obj = git_dir / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid
            obj.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, obj)
            dst.write_text(f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n")
        if not (Path(src) / ".gitattributes").exists():
            (git_dir / ".gitattributes").write_text(
                "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS_PATTERNS))
        _git(git_dir, "add", "-A")
        _git(git_dir, "commit", "-q", "--allow-empty", "-m", f"revision {i} from {Path(src).name}")
        _git(git_dir, "tag", f"v{i}")


class HubServer:
    """olah serving `repos` ("org/name" -> a directory, or a sequence of directories: one commit
    each on main, oldest first, commit i tagged v<i>) behind this module's counting,
    throttling, token-checking proxy. A context manager; start() and stop() also work."""

    def __init__(self, repos: Mapping[str, Path | Sequence[Path]], *, token: str | None = None,
                 host: str = "127.0.0.1", advertise_host: str | None = None,
                 workdir: Path | None = None, hub_compat: bool = True,
                 start_deadline_s: float = START_DEADLINE_S) -> None:
        for repo_id in repos:
            if repo_id.count("/") != 1:
                raise ValueError(f"repository ids are org/name, not {repo_id!r}")
        self.repos = {k: [Path(v)] if isinstance(v, (str, os.PathLike)) else [Path(p) for p in v]
                      for k, v in repos.items()}
        self.token = token
        self.host = host
        self.advertise_host = advertise_host or (host if host not in ("0.0.0.0", "") else "127.0.0.1")
        self.hub_compat = hub_compat
        self.start_deadline_s = start_deadline_s
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else None
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._proxy: _ProxyServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._bytes = 0
        self._rate = 0
        self._next_send = 0.0
        self._requests: list[tuple[str, str, int]] = []
        self._exists: dict[tuple[str, ...], bool] = {}
        self.olah_port = 0
        self.endpoint = ""

    # ---- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def mirror_path(self, repo_id: str) -> Path:
        return self.workdir / "mirrors" / "models" / repo_id

    def start(self) -> HubServer:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="kvpilot-hub-"))
        for repo_id, revisions in self.repos.items():
            build_mirror_repo(self.mirror_path(repo_id), revisions)

        self._proxy = _ProxyServer((self.host, 0), self)
        proxy_port = self._proxy.server_address[1]
        self.endpoint = f"http://{self.advertise_host}:{proxy_port}"
        self.olah_port = _free_port()
        netloc = f"{self.advertise_host}:{proxy_port}"  # URLs olah writes point at the proxy
        config = self.workdir / "olah.toml"
        config.write_text("\n".join([
            "[basic]",
            'host = "127.0.0.1"',
            f"port = {self.olah_port}",
            f"repos-path = {json.dumps(str(self.workdir / 'cache'))}",
            f"mirrors-path = [{json.dumps(str(self.workdir / 'mirrors'))}]",
            'mirror-scheme = "http"',
            f"mirror-netloc = {json.dumps(netloc)}",
            f"mirror-lfs-netloc = {json.dumps(netloc)}",
            'hf-scheme = "http"',
            'hf-netloc = "127.0.0.1:9"',  # never contacted offline; refused at once if it were
            'hf-lfs-netloc = "127.0.0.1:9"',
            "",
            "[accessibility]",
            "offline = true",
            "",
        ]))
        self._log = open(self.workdir / "olah.log", "wb")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "olah.server", "-c", str(config), "--log-path", str(self.workdir / "logs")],
            cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True)

        # Ready when olah answers, and serves every repository's main (its "/" page is no probe:
        # olah 0.5.4's index template fails with this starlette).
        probes = [f"/api/models/{quote(r, safe='/')}/revision/main" for r in self.repos] or ["/api/models/a/b/refs"]
        deadline = time.monotonic() + self.start_deadline_s
        status = None
        while probes:
            if self._proc.poll() is not None:
                raise RuntimeError(f"olah exited with {self._proc.returncode}:\n{self.log_tail()}")
            conn = http.client.HTTPConnection("127.0.0.1", self.olah_port, timeout=5)
            try:
                conn.request("GET", probes[0])
                resp = conn.getresponse()
                resp.read()
                status = resp.status
                if status == 200 or not self.repos:
                    probes.pop(0)
                    continue
            except OSError:
                pass
            finally:
                conn.close()
            if time.monotonic() > deadline:
                raise RuntimeError(f"olah not serving {probes[0]} after {self.start_deadline_s} s "
                                   f"(last status {status}):\n{self.log_tail()}")
            time.sleep(0.1)

        self._thread = threading.Thread(target=self._proxy.serve_forever, name="hub-proxy", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the proxy (closing client connections) and olah (and anything it started), and
        wait for both; remove the work directory if this object made it. Idempotent."""
        self._stopping.set()
        if self._proxy is not None:
            if self._thread is not None:
                self._proxy.shutdown()
            self._proxy.close_connections()
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(STOP_DEADLINE_S)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            try:  # git cat-file helpers GitPython started, if any outlived olah
                os.killpg(self._proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self._proc = None
        if self._proxy is not None:
            self._proxy.server_close()  # joins the handler threads
            self._proxy = None
        if self._thread is not None:
            self._thread.join(STOP_DEADLINE_S)
            self._thread = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._own_workdir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    @property
    def olah_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join((self.workdir / "olah.log").read_text(errors="replace").splitlines()[-n:])
        except (OSError, TypeError):
            return ""

    # ---- what tests read and set --------------------------------------------------------

    def commit(self, repo: str, ref: str = "main") -> str:
        """The commit sha the server reports for `ref` (model_info through the endpoint)."""
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.endpoint, token=self.token or False).model_info(repo, revision=ref).sha

    def bytes_served(self) -> int:
        """File bytes written to clients so far: bodies of 2xx answers to GET .../resolve/...
        (metadata JSON and headers are not counted)."""
        with self._lock:
            return self._bytes

    def requests(self) -> list[tuple[str, str, int]]:
        """(method, path with query, status) of every request the proxy answered, in order."""
        with self._lock:
            return list(self._requests)

    def set_throttle(self, bytes_per_sec: float) -> None:
        """Pace file bodies (all connections together) to bytes_per_sec; 0 turns it off."""
        with self._lock:
            self._rate = max(0.0, float(bytes_per_sec))
            self._next_send = 0.0

    # ---- used by the proxy --------------------------------------------------------------

    def _pace(self, n: int) -> None:
        with self._lock:
            if self._rate <= 0:
                return
            now = time.monotonic()
            self._next_send = max(now, self._next_send) + n / self._rate
            wait = self._next_send - now
        self._stopping.wait(wait)  # returns early when stop() is called

    def _served(self, n: int) -> None:
        with self._lock:
            self._bytes += n

    def _record(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self._requests.append((method, path, status))

    def _git_exists(self, repo_id: str, *spec: str) -> bool:
        """Whether `git cat-file -e spec` succeeds in the mirror of repo_id (cached)."""
        key = (repo_id, *spec)
        with self._lock:
            if key in self._exists:
                return self._exists[key]
        ok = subprocess.run(["git", "-C", str(self.mirror_path(repo_id)), "cat-file", "-e", *spec],
                            capture_output=True).returncode == 0
        with self._lock:
            self._exists[key] = ok
        return ok

    def _rev_exists(self, repo_id: str, rev: str) -> bool:
        return not rev.startswith("-") and self._git_exists(repo_id, f"{rev}^{{commit}}")


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = False  # server_close() joins them: stop() leaves no thread behind
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], hub: HubServer) -> None:
        self.hub = hub
        self.connections: set[socket.socket] = set()
        self.conn_lock = threading.Lock()
        super().__init__(address, _ProxyHandler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks the host name up (socket.getfqdn), which can hang
        # where there is no DNS; nothing here needs it.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def close_connections(self) -> None:
        with self.conn_lock:
            for sock in self.connections:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 120
    server: _ProxyServer

    def setup(self) -> None:
        super().setup()
        self.upstream: http.client.HTTPConnection | None = None
        with self.server.conn_lock:
            self.server.connections.add(self.connection)

    def finish(self) -> None:
        with self.server.conn_lock:
            self.server.connections.discard(self.connection)
        if self.upstream is not None:
            self.upstream.close()
        try:
            super().finish()
        except OSError:
            pass

    def log_message(self, format, *args) -> None:
        pass

    def do_GET(self) -> None:
        try:
            self._handle()
        except (OSError, http.client.HTTPException):  # a client or olah went away mid-answer
            self.close_connection = True

    do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_GET

    # ---- answering ----------------------------------------------------------------------

    def _reply(self, status: int, headers: Mapping[str, str], body: bytes = b"") -> None:
        self.send_response_only(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.server.hub._record(self.command, self.path, status)

    def _error(self, status: int, code: str | None, message: str) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message}
        if code is not None:
            headers["X-Error-Code"] = code
        self._reply(status, headers, json.dumps({"error": message}).encode())

    def _handle(self) -> None:
        hub = self.server.hub
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None

        if hub.token is not None:
            auth = self.headers.get("Authorization")
            if auth is None:  # as the Hub answers for a private repository
                return self._error(401, "RepoNotFound", "Repository not found")
            if auth != f"Bearer {hub.token}":
                return self._error(401, None, "Invalid credentials in Authorization header")

        split = urlsplit(self.path)
        path, query = split.path, split.query
        is_file = False
        enrich = False
        if m := _RESOLVE.match(path):
            is_file = True
        m = m or _API.match(path)
        if m and hub.hub_compat and f"{unquote(m['org'])}/{unquote(m['name'])}" in hub.repos:
            repo_id = f"{unquote(m['org'])}/{unquote(m['name'])}"
            kind = "resolve" if is_file else m["kind"]
            if kind is None:
                if self.command in ("GET", "HEAD"):
                    path = f"{path}/revision/main"
            else:
                rev = unquote(m["rev"])
                if not hub._rev_exists(repo_id, rev):
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                if is_file and not hub._git_exists(repo_id, f"{rev}:{unquote(m['file'])}"):
                    return self._error(404, "EntryNotFound", f'{unquote(m["file"])} does not exist on "{rev}"')
                enrich = (kind == "revision" and self.command == "GET"
                          and parse_qs(query).get("blobs", [""])[-1].lower() in ("1", "true"))

        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        if not any(k.lower() == "host" for k in headers):
            headers["Host"] = f"127.0.0.1:{hub.olah_port}"
        target = path + (f"?{query}" if query else "")
        try:
            resp = self._upstream(self.command, target, body, headers)
        except (OSError, http.client.HTTPException) as e:
            if self.upstream is not None:
                self.upstream.close()
                self.upstream = None
            return self._error(502, None, f"olah did not answer: {e!r}")

        if enrich and resp.status == 200:
            return self._reply_enriched(resp, m)

        out = [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP_BY_HOP]
        has_length = resp.getheader("Content-Length") is not None
        no_body = self.command == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
        chunked = not has_length and not no_body and self.request_version == "HTTP/1.1"
        if not has_length and not no_body and not chunked:
            self.close_connection = True
        self.send_response_only(resp.status)
        for k, v in out:
            self.send_header(k, v)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        counted = is_file and self.command == "GET" and 200 <= resp.status < 300
        try:
            if not no_body:
                while chunk := resp.read1(CHUNK):
                    if counted:
                        hub._pace(len(chunk))
                        if hub._stopping.is_set():
                            raise ConnectionResetError("hub server stopping")
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                    if counted:
                        hub._served(len(chunk))
                if chunked:
                    self.wfile.write(b"0\r\n\r\n")
            resp.close()  # read to the end: frees the kept-alive connection to olah for the next request
            self.wfile.flush()
        except BaseException:
            if self.upstream is not None:  # half-read: the connection can't be reused
                self.upstream.close()
                self.upstream = None
            raise
        finally:
            hub._record(self.command, self.path, resp.status)

    def _upstream(self, method: str, target: str, body: bytes | None, headers: dict) -> http.client.HTTPResponse:
        """Send to olah on this handler's kept-alive connection (one retry on a stale one).
        The client's Host header goes along, so URLs olah builds from it point at the proxy."""
        for attempt in (0, 1):
            if self.upstream is None:
                self.upstream = http.client.HTTPConnection("127.0.0.1", self.server.hub.olah_port, timeout=120)
            try:
                self.upstream.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
                for k, v in headers.items():
                    self.upstream.putheader(k, v)
                if body is not None and "content-length" not in {k.lower() for k in headers}:
                    self.upstream.putheader("Content-Length", str(len(body)))
                self.upstream.endheaders(body)
                return self.upstream.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.upstream.close()
                self.upstream = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _reply_enriched(self, resp: http.client.HTTPResponse, m: re.Match) -> None:
        """model_info(files_metadata=True): olah's metadata plus, for each sibling, the size,
        blob id and LFS info olah's own tree listing gives for the same commit."""
        info = json.loads(resp.read())
        resp.close()
        tree_path = f"/api/models/{m['org']}/{m['name']}/tree/{quote(info['sha'], safe='')}/?recursive=true"
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP | {"content-length"}}
        tree_resp = self._upstream("GET", tree_path, None, headers)
        tree = json.loads(tree_resp.read())
        tree_resp.close()
        if tree_resp.status != 200:
            return self._error(502, None, f"olah tree listing answered {tree_resp.status}")
        by_path = {e["path"]: e for e in tree if e.get("type") == "file"}
        for sib in info.get("siblings") or []:
            entry = by_path.get(sib["rfilename"])
            if entry is None:
                continue
            sib["size"] = entry["size"]
            sib["blobId"] = entry["oid"]
            if "lfs" in entry:
                lfs = entry["lfs"]
                sib["lfs"] = {"sha256": lfs["oid"], "size": lfs["size"], "pointerSize": lfs["pointerSize"]}
        keep = {k: v for k, v in resp.getheaders() if k.lower() not in HOP_BY_HOP | {"content-length"}}
        self._reply(200, keep, json.dumps(info).encode())
