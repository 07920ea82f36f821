"""A real S3-compatible server for the s3:// model source tests: gofakes3 built from the Go
module proxy by e2e/s3server/build.sh, run as a subprocess on a free port, with its test hooks
(bytes served, GET count, throttle) read over HTTP. Not a fixture: tests wrap it in their own.

    with S3Server() as s3:
        s3.upload_dir("models", "tiny", model_dir)
        ... load s3://models/tiny with s3.endpoint, s3.access_key, s3.secret_key ...
        assert s3.bytes_served() == total_size
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from go_tools import built_tool

START_DEADLINE_S = 30.0


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class S3Server:
    """host: the address to listen on ("0.0.0.0" so pods of a local cluster reach it);
    advertise_host: the address clients use in .endpoint (default: host, or 127.0.0.1 for
    0.0.0.0); root: keep objects as files there (default: a temporary folder, removed by stop);
    memory: keep them in memory instead (gofakes3's s3mem: the only backend whose listings
    honour MaxKeys; on files, a listing is always one page)."""

    # gofakes3 accepts any credentials (it does not check signatures); clients still sign.
    access_key = "kvpilot-test-key"
    secret_key = "kvpilot-test-secret"
    region = "us-east-1"

    def __init__(self, host: str = "127.0.0.1", advertise_host: str | None = None,
                 root: str | Path | None = None, memory: bool = False, throttle_bps: int = 0) -> None:
        self.binary = built_tool("s3server/build.sh", "s3server")
        self.host = host
        self.advertise_host = advertise_host or ("127.0.0.1" if host == "0.0.0.0" else host)
        self._tmp = tempfile.mkdtemp(prefix="kvpilot-s3-")
        self.root = None if memory else Path(root) if root is not None else Path(self._tmp) / "data"
        self.log_path = Path(self._tmp) / "s3server.log"
        self.throttle_bps = throttle_bps
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.advertise_host}:{self.port}"

    def start(self) -> S3Server:
        try:
            # A free port can be taken between probing and binding: try a few.
            for _ in range(3):
                self.port = _free_port(self.host)
                with open(self.log_path, "ab") as log:
                    self.proc = subprocess.Popen(
                        [self.binary, "--addr", f"{self.host}:{self.port}", "--root", str(self.root or ""),
                         "--throttle-bytes-per-sec", str(self.throttle_bps)],
                        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                if self._wait_ready():
                    return self
            raise RuntimeError(f"s3server did not start; its log:\n{self._log_tail()}")
        except BaseException:
            self.stop()  # __exit__ does not run when __enter__ raises
            raise

    def _wait_ready(self) -> bool:
        """True once the stats hook answers; False if the process exited (port taken)."""
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                self.stats()
                return True
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"s3server not ready after {START_DEADLINE_S} s; its log:\n{self._log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    # --- the S3 API, as a client sees it ---------------------------------------------------

    def client(self):
        """A boto3 S3 client for this server: path-style (no bucket.host DNS names)."""
        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name=self.region,
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}))

    def upload_dir(self, bucket: str, prefix: str, path: str | Path) -> list[str]:
        """Uploads every file under PATH as PREFIX/RELATIVE (boto3's upload_file: multipart
        above 8 MB), creating BUCKET if needed; returns the keys, sorted."""
        c = self.client()
        try:
            c.head_bucket(Bucket=bucket)
        except ClientError:
            c.create_bucket(Bucket=bucket)
        base = Path(path)
        keys = []
        for f in sorted(p for p in base.rglob("*") if p.is_file()):
            key = "/".join(filter(None, [prefix.strip("/"), f.relative_to(base).as_posix()]))
            c.upload_file(str(f), bucket, key)
            keys.append(key)
        return keys

    # --- the test hooks (e2e/s3server/main.go) ---------------------------------------------

    def stats(self) -> dict[str, int]:
        with urllib.request.urlopen(f"http://{self._local_host()}:{self.port}/_kvpilot/stats", timeout=5) as r:
            return json.load(r)

    def bytes_served(self) -> int:
        """Body bytes of GET object responses written to their connections so far."""
        return self.stats()["object_bytes_served"]

    def get_requests(self) -> int:
        """GET object responses that began with 200 or 206 so far."""
        return self.stats()["get_object_requests"]

    def set_throttle(self, bps: int) -> None:
        """Limits all GET object bodies together to BPS bytes/s from now on; 0 lifts it."""
        url = f"http://{self._local_host()}:{self.port}/_kvpilot/throttle?bps={int(bps)}"
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=5) as r:
            assert json.load(r)["throttle_bytes_per_sec"] == bps

    def _local_host(self) -> str:
        # The hooks are read from this machine, whatever address clients are given.
        return "127.0.0.1" if self.host == "0.0.0.0" else self.host
