"""Train a tiny model on Python's standard library sources: the loop behind
`kvpilot make-tiny-model --train` and the `builtin:tiny-trained` / `builtin:tiny-draft` models.

The text is the stdlib's top-level `*.py` files (where tiny_tokenizer learns its BPE),
split by file: a file is held out when the CRC-32 of its name is 0 mod `HELDOUT_EVERY`.
Training starts from the weights make_tiny_model writes with the same seed (the
untrained baseline) and draws its windows from a generator seeded with that seed, so a
seed gives byte-identical weights on one machine.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import sysconfig
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config.model import ModelConfig
from ..models.llama_train import TrainableLlama
from ..config.validation import positive_int

HELDOUT_EVERY = 10  # about one file in ten is held out
TRAINING_REPORT = "training.json"
# The draft for speculative decoding: same tokenizer and vocabulary as the target
# (make-tiny-model defaults), a quarter of its width and half its depth.
DRAFT_SHAPE = dict(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=344)


@dataclass(frozen=True)
class TrainConfig:
    """The recipe. Changing a default changes the built-in trained models: bump their
    cache names in model_source.BUILTIN_MODELS."""

    steps: int = 600
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    warmup_fraction: float = 0.05  # linear warm-up, then cosine decay to min_lr_fraction * lr
    min_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    eval_tokens: int = 32768  # held-out tokens scored for perplexity

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_tokens"):
            positive_int(name, getattr(self, name))
        for name, low, high in (("lr", 0.0, 1.0), ("warmup_fraction", 0.0, 1.0),
                                ("min_lr_fraction", 0.0, 1.0), ("weight_decay", 0.0, 1.0)):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or not (low < value < high if name == "lr" else low <= value <= high):
                raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")
        if self.eval_tokens < self.seq_len + 1:
            raise ValueError(f"eval_tokens={self.eval_tokens} must be more than seq_len={self.seq_len}")


def corpus_split() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): the stdlib's top-level sources, sorted by name."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    held = [f for f in files if zlib.crc32(f.name.encode()) % HELDOUT_EVERY == 0]
    train = [f for f in files if zlib.crc32(f.name.encode()) % HELDOUT_EVERY != 0]
    if not held or not train:
        raise RuntimeError(f"training needs Python's standard library sources; {stdlib} has "
                           f"{len(files)} *.py files")
    return train, held


def encode_files(tokenizer, files: list[Path]) -> torch.Tensor:
    """All files as one token stream [tokens], each opening with BOS (the tokenizer adds it)."""
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    ids = [i for enc in tokenizer.encode_batch(texts) for i in enc.ids]
    return torch.tensor(ids, dtype=torch.long)


def heldout_windows(stream: torch.Tensor, seq_len: int, max_tokens: int) -> torch.Tensor:
    """The stream's first non-overlapping windows of seq_len + 1 tokens, up to max_tokens:
    [windows, seq_len + 1]. Each predicts its last seq_len tokens."""
    n = min(len(stream), max_tokens) // (seq_len + 1)
    if n == 0:
        raise ValueError(f"seq_len={seq_len}: the held-out text has only {len(stream)} tokens")
    return stream[:n * (seq_len + 1)].view(n, seq_len + 1)


@torch.no_grad()
def heldout_perplexity(model: TrainableLlama, windows: torch.Tensor, batch_size: int = 8) -> float:
    """exp(mean next-token cross-entropy) over windows [n, seq_len + 1]."""
    model.eval()
    total, count = 0.0, 0
    for chunk in windows.split(batch_size):
        logits = model(chunk[:, :-1])  # [batch, seq, vocab]
        total += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
        count += chunk[:, 1:].numel()
    return math.exp(total / count)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over the first warmup_fraction of steps, then cosine decay."""
    warmup = max(1, round(cfg.warmup_fraction * cfg.steps))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    floor = cfg.min_lr_fraction * cfg.lr
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def train(model: TrainableLlama, stream: torch.Tensor, cfg: TrainConfig, seed: int,
          progress: bool = True) -> list[float]:
    """Run cfg.steps AdamW steps on random windows of `stream` [tokens]; the loss of each."""
    from tqdm.auto import tqdm

    if len(stream) <= cfg.seq_len + 1:
        raise ValueError(f"seq_len={cfg.seq_len}: the training text has only {len(stream)} tokens")
    gen = torch.Generator().manual_seed(seed)
    # Norm weights and embeddings keep their scale; only projections decay.
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    offsets = torch.arange(cfg.seq_len + 1)  # [seq + 1]
    tokens_per_step = cfg.batch_size * cfg.seq_len
    losses: list[float] = []
    model.train()
    start = time.perf_counter()
    with tqdm(total=cfg.steps, desc="train", unit="step", file=sys.stderr, disable=not progress,
              mininterval=0.5) as bar:
        for step in range(cfg.steps):
            starts = torch.randint(0, len(stream) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
            batch = stream[starts[:, None] + offsets]  # [batch, seq + 1]
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            logits = model(batch[:, :-1])  # [batch, seq, vocab]
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            rate = (step + 1) * tokens_per_step / (time.perf_counter() - start)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{rate:.0f}", refresh=False)
            bar.update(1)
    model.eval()
    return losses


def train_model_dir(model_dir: Path, cfg: TrainConfig, seed: int, progress: bool = True) -> dict:
    """Train the model in `model_dir` in place: rewrite model.safetensors and write
    training.json; return that report."""
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer

    began = time.perf_counter()
    config = ModelConfig.from_dir(model_dir)
    if config.max_position_embeddings < cfg.seq_len:
        raise ValueError(f"seq_len={cfg.seq_len} exceeds max_position_embeddings="
                         f"{config.max_position_embeddings}")
    weights_path = model_dir / "model.safetensors"
    saved = load_file(str(weights_path))
    model = TrainableLlama(config, cfg.seq_len)
    model.load_checkpoint({k: t.float() for k, t in saved.items()})  # train in float32
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    train_files, held_files = corpus_split()
    stream = encode_files(tokenizer, train_files)  # [tokens]
    windows = heldout_windows(encode_files(tokenizer, held_files), cfg.seq_len, cfg.eval_tokens)
    before = heldout_perplexity(model, windows)

    train_began = time.perf_counter()
    losses = train(model, stream, cfg, seed, progress)
    train_seconds = time.perf_counter() - train_began
    # Score what is written: the weights in the checkpoint's own dtype.
    dtype = next(iter(saved.values())).dtype
    trained = {k: t.to(dtype).contiguous() for k, t in model.checkpoint().items()}
    model.load_checkpoint({k: t.float() for k, t in trained.items()})
    after = heldout_perplexity(model, windows)
    save_file(trained, str(weights_path), metadata={"format": "pt"})
    weights_path.chmod(0o644)

    tail = losses[-max(1, len(losses) // 10):]
    report = {
        "recipe": asdict(cfg),
        "seed": seed,
        "corpus": "Python standard library, top-level *.py files",
        "train_files": len(train_files),
        "heldout_files": len(held_files),
        "train_stream_tokens": len(stream),
        "tokens_trained": cfg.steps * cfg.batch_size * cfg.seq_len,
        "heldout_tokens_scored": windows[:, 1:].numel(),
        "train_loss_first": losses[0],
        "train_loss_last_tenth": sum(tail) / len(tail),
        "heldout_perplexity_before": before,
        "heldout_perplexity_after": after,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - began, 1),
        "torch_threads": torch.get_num_threads(),
    }
    (model_dir / TRAINING_REPORT).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (model_dir / TRAINING_REPORT).chmod(0o644)
    return report


def make_trained_model(out_dir, *, train_config: TrainConfig | None = None, seed: int = 0,
                       progress: bool = True, **shape) -> Path:
    """make_tiny_model(out_dir, seed=seed, **shape), trained with `train_config` before it
    appears: the finished folder is moved into place, as make_tiny_model does."""
    from .model import _move_into_place, make_tiny_model

    cfg = train_config or TrainConfig()
    out = Path(out_dir).expanduser().absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.train-", dir=out.parent))
    try:
        model_dir = make_tiny_model(staging / "model", seed=seed, **shape)
        train_model_dir(model_dir, cfg, seed, progress)
        _move_into_place(model_dir, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
