"""The `kvpilot` command. Subcommands import their heavy dependencies lazily."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
import threading

from .config.args import add_engine_args, engine_config_from_args

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
COMMANDS_GROUP = "kvpilot.commands"  # entry points: add_parser(subparsers) of more commands
# make-tiny-model --train-FIELD flags: TrainConfig fields a user may set (unset: its default).
_TRAIN_FLAGS = {"steps": int, "batch_size": int, "seq_len": int, "lr": float}


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from .tiny.model import make_tiny_model

    shape = dict(
        arch=args.arch, layers=args.layers, hidden=args.hidden, heads=args.heads,
        kv_heads=args.kv_heads, intermediate=args.intermediate, vocab=args.vocab,
        seed=args.seed, dtype=args.dtype, max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=args.tie_word_embeddings, rope_theta=args.rope_theta,
        rope_scaling=json.loads(args.rope_scaling) if args.rope_scaling else None,
    )
    recipe = {field: getattr(args, f"train_{field}") for field in _TRAIN_FLAGS
              if getattr(args, f"train_{field}") is not None}
    if not args.train:
        if recipe:
            flags = ", ".join(f"--train-{f.replace('_', '-')}" for f in recipe)
            raise ValueError(f"{flags}: only with --train")
        print(make_tiny_model(args.dir, **shape))
        return 0
    from .tiny.train import TRAINING_REPORT, TrainConfig, make_trained_model

    path = make_trained_model(args.dir, train_config=TrainConfig(**recipe), **shape)
    report = json.loads((path / TRAINING_REPORT).read_text())
    print(f"held-out perplexity: untrained {report['heldout_perplexity_before']:.1f}, "
          f"trained {report['heldout_perplexity_after']:.2f} "
          f"({report['recipe']['steps']} steps, {report['train_seconds']:.0f} s of training)",
          file=sys.stderr)
    print(path)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from .llm import LLM
    from .core.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    llm = LLM(**vars(config))
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=config.seed,
        top_p=args.top_p, top_k=args.top_k,
    )
    out = llm.generate([args.prompt], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    if args.json:
        print(json.dumps({
            "prompt": args.prompt, "text": completion.text, "token_ids": completion.token_ids,
            "prompt_tokens": len(out.prompt_token_ids), "finish_reason": completion.finish_reason,
        }))
    else:
        print(args.prompt + completion.text)
    return 0


def _version() -> str:
    """The installed distribution's version (what an image tag carries)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvpilot")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


class _Parser(argparse.ArgumentParser):
    """argparse failing like a tool: a wrong value is one line naming the flag (and, for a
    choice, the valid ones). Only an unrecognized flag (a typo) or a missing required one
    (argparse checks those first, so a typo of a required flag reads so) also prints the
    usage of the (sub)command it was given to, which lists its flags. Subcommands' parsers
    are of this class too (argparse makes them with their parent's class)."""

    def error(self, message: str):
        if message.startswith(("unrecognized arguments", "the following arguments are required")) \
                or message.endswith(" is required"):  # one of a required group
            self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _log_level_everywhere(parser: argparse.ArgumentParser) -> None:
    """Let --log-level follow any subcommand too (`kvpilot serve --log-level debug`), as
    users type it; unset there, the top level's value stands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in set(action.choices.values()):
                if "--log-level" not in child._option_string_actions:
                    child.add_argument("--log-level", default=argparse.SUPPRESS, type=str.upper,
                                       choices=LOG_LEVELS, help="as before the subcommand")
                _log_level_everywhere(child)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvpilot", description=__doc__)
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny-model", help="write a small HF-format model (random, or --train)")
    p.add_argument("dir")
    p.add_argument("--arch", default="llama", choices=("llama", "qwen2", "mistral"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--max-position-embeddings", type=int, default=4096)
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--rope-scaling", default=None, help='JSON, e.g. {"rope_type":"llama3",...}')
    p.add_argument("--train", action="store_true",
                   help="train it on Python standard library sources (a few minutes on a CPU)")
    for field, kind in _TRAIN_FLAGS.items():
        p.add_argument(f"--train-{field.replace('_', '-')}", type=kind, default=None,
                       help=f"with --train: {field} (default: tiny_train.TrainConfig's)")
    p.set_defaults(func=_cmd_make_tiny_model)

    p = sub.add_parser("generate", help="generate one completion offline")
    add_engine_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    # Each module registers its own parser and imports its heavy dependencies only
    # when its command runs. Commands of other kvpilot packages (the operator's) come in
    # as entry points of the group "kvpilot.commands", so the engine never names them.
    from importlib.metadata import entry_points

    from .bench import overhead as bench_overhead, parallel as bench_parallel, quantization as bench_quantization, serve as bench_serve, soak as bench_soak, speculative as bench_speculative, throughput as bench_throughput
    from .fetch import cli as fetch_cli
    from .server import cli as server_cli
    from .fleet import cli as sim_cli

    bench_throughput.add_parser(bench)
    bench_serve.add_parser(bench)
    bench_overhead.add_parser(bench)
    bench_soak.add_parser(bench)
    bench_speculative.add_parser(bench)
    bench_quantization.add_parser(bench)
    bench_parallel.add_parser(bench)
    server_cli.add_parser(sub)
    fetch_cli.add_parser(sub)
    sim_cli.add_parser(sub)
    for ep in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        ep.load()(sub)
    _log_level_everywhere(parser)
    return parser


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The deepest subcommand's parser the arguments chose (`kvpilot bench serve`'s, say)."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subs[0].dest, None) if subs else None
        if chosen not in (subs[0].choices if subs else {}):
            return parser
        parser = subs[0].choices[chosen]


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, str]:
    """The arguments and the chosen subcommand's prog (`kvpilot bench serve`). An unknown
    flag is reported with the usage of the subcommand it was given to (argparse reports it
    with the top-level usage, which does not list the subcommand's flags)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    chosen = _chosen_parser(parser, args)
    if extra:
        chosen.error(f"unrecognized arguments: {' '.join(extra)}")
    return args, chosen.prog


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Like argparse's parse_args, with _parse's errors."""
    return _parse(argv)[0]


class Terminated(BaseException):
    """SIGTERM arrived before the command installed a handler of its own."""


def _terminated(signum, frame) -> None:
    raise Terminated


@contextlib.contextmanager
def _sigterm_ends_the_command():
    """In a container kvpilot is PID 1, and the kernel drops a signal that PID 1 has no
    handler for: a pod deleted while it starts (imports, a model download, loading weights)
    would wait out its whole grace period, then be killed. Until the command installs its own
    handler (the server's drain, uvicorn's, kopf's), SIGTERM ends it; the previous handler is
    back afterwards (main() also runs inside tests)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set a handler
        return
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    """Errors are a line on stderr and a non-zero exit, never a traceback: 2 for a wrong
    invocation (argparse's, or a ValueError naming the flag), 1 for anything else (its
    traceback with --log-level DEBUG), 130 for Ctrl-C, 143 for a SIGTERM that the command
    does not handle itself."""
    with _sigterm_ends_the_command():
        try:
            return _run(argv)
        except Terminated:
            print("kvpilot: terminated (SIGTERM)", file=sys.stderr)
            return 143


def _run(argv: list[str] | None) -> int:
    args, prog = _parse(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvpilot: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 (a command's failure is one line; DEBUG shows where)
        logging.getLogger("kvpilot").debug("%s failed", args.command, exc_info=True)
        detail = str(exc).splitlines()[0] if str(exc) else ""
        print(f"{prog}: error: {type(exc).__name__}{': ' + detail if detail else ''}"
              f"{'' if args.log_level == 'DEBUG' else ' (--log-level DEBUG shows the traceback)'}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
