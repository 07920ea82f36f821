"""`kvpilot fetch-model SOURCE`: download an hf:// or s3:// model into the cache (the
operator's init container runs it; a user can run it to try a deployment's exact model).

Credentials and endpoints come from the environment, as huggingface_hub and boto3 read
them: HF_TOKEN, HF_ENDPOINT; AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL,
AWS_REGION, and KVPILOT_S3_PATH_STYLE=1. With --json-progress, stdout carries one JSON
object per line (the operator reads the last one from the pod's log); the snapshot's path
is the last line either way. A failure is one line (no traceback), exit code 2, and, with
--termination-log, a JSON {reason, message} there for the operator's condition."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def _cmd_fetch_model(args: argparse.Namespace) -> int:
    from .base import ModelFetchError
    from .download import FetchOptions, fetch
    from ..config.cache_root import cache_dir
    from .uri import FileSelection

    def progress(p) -> None:
        if args.json_progress:
            print(json.dumps(p.dump()), flush=True)
        else:
            print(p.line(), file=sys.stderr, flush=True)

    if args.json_progress:  # keep stdout/stderr to progress lines: the operator reads the log's tail
        for noisy in ("httpx", "httpx2", "huggingface_hub", "botocore", "boto3", "urllib3", "s3transfer"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    models_dir = Path(args.cache_dir) if args.cache_dir else cache_dir() / "models"
    options = FetchOptions.from_env(models_dir, selection=FileSelection(tuple(args.include)),
                                    progress=progress, interval_s=args.interval)
    try:
        result = fetch(args.source, options)
    except ModelFetchError as e:
        _termination(args.termination_log, {"reason": e.reason, "message": str(e)})
        raise
    except ValueError as e:  # a malformed source
        _termination(args.termination_log, {"reason": "InvalidSource", "message": str(e)})
        raise
    _termination(args.termination_log, {"reason": "Ready", "revision": result.revision, "files": result.files,
                                        "total": result.total_bytes, "downloaded": result.downloaded,
                                        "path": str(result.path)})
    print(result.path, flush=True)
    return 0


def _termination(path: str | None, payload: dict) -> None:
    """Kubernetes shows this file's text as the container's termination message (4 KiB at most)."""
    if path:
        try:
            Path(path).write_text(json.dumps(payload)[:4000])
        except OSError:
            pass  # not in a pod, or no such file: the log has the same line


def add_parser(sub) -> None:
    p = sub.add_parser("fetch-model", help="download an hf:// or s3:// model into the cache",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="hf://ORG/NAME[@REVISION] or s3://BUCKET/PREFIX")
    p.add_argument("--cache-dir", default=None,
                   help="the models folder (default: $KVPILOT_CACHE_DIR/models)")
    p.add_argument("--include", action="append", default=[], metavar="GLOB",
                   help="also fetch files matching GLOB (e.g. 'original/*'); by default only config, "
                        "tokenizer and *.safetensors files at the top level")
    p.add_argument("--json-progress", action="store_true", help="progress as JSON lines on stdout")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between progress reports")
    p.add_argument("--termination-log", default=None, help="write the outcome as JSON here")
    p.set_defaults(func=_cmd_fetch_model)
