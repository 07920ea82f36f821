"""Entry point of the node agent: python -m localcluster.node --config node.json"""
from __future__ import annotations

import argparse
import logging
import signal
import threading
from pathlib import Path

from .agent import Node, NodeConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", required=True, type=Path)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    node = Node(NodeConfig.from_json(args.config.read_text()))
    done = threading.Event()

    def on_signal(signum, frame):
        if not done.is_set():
            done.set()
            threading.Thread(target=node.stop, daemon=False).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    node.run()
    logging.info("node stopped")


if __name__ == "__main__":
    main()
