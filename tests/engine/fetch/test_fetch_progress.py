"""The download meter's last figure: a sample the meter's thread took while a file was being
renamed into place counts that file short, and it must not be the figure a fetch reports."""
from __future__ import annotations

import threading

from kvpilot.engine.fetch import download
from kvpilot.engine.fetch.base import Progress


def test_the_last_figure_is_taken_once_the_meters_thread_has_stopped(tmp_path, monkeypatch):
    folder = tmp_path / "partial"
    folder.mkdir()
    (folder / "model.safetensors.incomplete").write_bytes(b"x" * 100)  # resumed from here
    real = download.bytes_on_disk
    in_sample, release = threading.Event(), threading.Event()

    def stale_in_the_thread(path):
        if threading.current_thread().name != "kvpilot-fetch-progress":
            return real(path)
        seen = real(path) - 40  # a 40-byte file renamed away between the walk and its lstat
        in_sample.set()
        release.wait(10)
        return seen

    monkeypatch.setattr(download, "bytes_on_disk", stale_in_the_thread)
    progress = Progress("Downloading", "s3://models/tiny", total=1000, files=2)
    with download._Meter(progress, folder, None, interval_s=0.001):
        (folder / "config.json").write_bytes(b"c" * 40)
        (folder / "model.safetensors.incomplete").write_bytes(b"x" * 300)
        assert in_sample.wait(10), "the meter's thread never sampled"
        # The thread's stale sample finishes while the meter is being closed.
        threading.Timer(0.05, release.set).start()
    assert progress.downloaded == 340 - 100 and progress.done == 340
