"""Read a model directory's safetensors weights, one tensor at a time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """model.safetensors; else the shards the index names; else every *.safetensors."""
    folder = Path(model_dir)
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    if (folder / INDEX_FILE).is_file():
        weight_map = json.loads((folder / INDEX_FILE).read_text()).get("weight_map") or {}
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ValueError(f"model: {folder / INDEX_FILE} names missing shards: {missing}")
        if shards:
            return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: {folder} has no *.safetensors weights")
    return files


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for every weight, with a progress bar on a terminal."""
    files = safetensors_files(model_dir)
    total = 0
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            total += len(list(f.keys()))
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=None) as bar:
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
                    bar.update(1)
