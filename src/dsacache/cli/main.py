"""``dsacache`` command line: ``plan``, ``simulate`` and ``bench``.

Bad settings (argument errors included) exit with status 2 and one ``dsacache: error: ...``
line, never a traceback; output cut short by a closed pipe (``| head``) ends quietly with
status 141, as a command killed by SIGPIPE does. ``plan`` imports no torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys

from dsacache.config.model import BUILTIN_MODELS, ConfigError, load_model, show
from dsacache.config.serving import (
    DEFAULT_CACHE_FRACTION,
    H200_MEMORY_BYTES,
    INDEXER_BACKENDS,
    PD_REFERENCE_TP,
    TARGET_ARCHS,
    CacheConfig,
    SpeculativeConfig,
    parse_attention_config,
)
from dsacache.formats.sizes import KV_CACHE_DTYPES

DEFAULT_MODEL = "kimi-k3.1"
DEFAULT_CONTEXT_LENGTH = 32768
#: Most TP sizes in one ``--tensor-parallel-size`` list (the table compares every pair).
MAX_TP_LIST = 32
#: Exit status of a command whose output pipe closed (128 + SIGPIPE).
EXIT_BROKEN_PIPE = 141
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str) -> int:
    """``"48GiB"``, ``"50GB"``, ``"5e10"`` or ``"123456"`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {show(text)} (examples: 48GiB, 50GB, 5e10)")
    try:
        value = float(match.group(1)) * _UNITS[match.group(2).upper()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {show(text)} (examples: 48GiB, 50GB, 5e10)") from None
    if not math.isfinite(value) or value >= 2**63:
        raise argparse.ArgumentTypeError(f"byte size {show(text)} is too large (at most 2**63 - 1 B)")
    return int(value)


def parse_tp_list(text: str) -> list[int]:
    """``"8"`` or ``"1,2,4,8"`` -> a list of distinct TP sizes (at most ``MAX_TP_LIST``)."""
    parts = [v for v in text.split(",") if v.strip()]
    if len(parts) > MAX_TP_LIST:
        raise argparse.ArgumentTypeError(f"at most {MAX_TP_LIST} tensor parallel sizes, got {len(parts)}")
    try:
        values = [int(v) for v in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"tensor parallel size must be an integer or a comma list, got {show(text)}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"tensor parallel sizes must be >= 1, got {show(text)}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"tensor parallel sizes must be distinct, got {show(text)}")
    return values


class ArgumentParser(argparse.ArgumentParser):
    """An argument error is one ``dsacache: error:`` line pointing at ``--help`` (exit 2), no usage block."""

    def error(self, message: str):
        self.exit(2, f"dsacache: error: {message} (see '{self.prog} --help')\n")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and serving options shared by ``plan`` and ``simulate`` (vLLM spellings)."""
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--config", metavar="PATH", help="a config.json (top level or text_config), or its directory")
    src.add_argument("--model", default=None, help=f"a built-in model: {', '.join(BUILTIN_MODELS)} "
                                                   f"(default {DEFAULT_MODEL})")
    parser.add_argument("--tensor-parallel-size", "-tp", type=parse_tp_list, default=[8], metavar="N[,N...]",
                        help="TP size, or a comma list such as 1,2,4,8,16 for a table (default 8)")
    parser.add_argument("--kv-cache-dtype", default="fp8_ds_mla", choices=KV_CACHE_DTYPES,
                        help="MLA latent cache dtype (default fp8_ds_mla)")
    parser.add_argument("--attention-config", metavar="JSON", default=None,
                        help='e.g. \'{"indexer_kv_dtype": "mxfp4"}\' (auto|fp8|mxfp4; default auto = fp8)')
    parser.add_argument("--speculative-config", metavar="JSON", default=None,
                        help='e.g. \'{"method": "dspark", "num_speculative_tokens": 3, "model": "kimi-k3.1-dspark"}\'')
    parser.add_argument("--prefill-context-parallel-size", type=int, default=1, metavar="N")
    parser.add_argument("--decode-context-parallel-size", type=int, default=1, metavar="N")
    parser.add_argument("--cp-kv-cache-interleave-size", type=int, default=1, metavar="N",
                        help="under DCP, consecutive tokens a rank stores before the next one's turn (default 1)")
    parser.add_argument("--target-arch", default="sm90", choices=TARGET_ARCHS,
                        help="GPU architecture; decides which backends can read MXFP4 keys (default sm90)")
    parser.add_argument("--indexer-backend", default="triton", choices=INDEXER_BACKENDS,
                        help="indexer logits backend that must read the keys (default triton)")
    parser.add_argument("--reference-tp", type=int, default=PD_REFERENCE_TP, metavar="N",
                        help=f"TP size the packed block size is computed at (default {PD_REFERENCE_TP})")
    budget = parser.add_argument_group("memory budget (per GPU)")
    budget.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=None, metavar="SIZE",
                        help="bytes for the pool, e.g. 48GiB (overrides the two options below)")
    budget.add_argument("--gpu-memory", type=parse_bytes, default=H200_MEMORY_BYTES, metavar="SIZE",
                        help="GPU memory (default 141GB, an H200)")
    budget.add_argument("--cache-fraction", type=float, default=DEFAULT_CACHE_FRACTION, metavar="F",
                        help=f"share of --gpu-memory left for the cache after weights and activations "
                             f"(default {DEFAULT_CACHE_FRACTION})")


def configs_from_args(args: argparse.Namespace) -> list[CacheConfig]:
    """One validated :class:`CacheConfig` per requested TP size."""
    if args.config is not None:
        try:
            model = load_model(args.config)
        except ConfigError as exc:
            raise ConfigError(f"--config: {exc}") from None
    elif (DEFAULT_MODEL if args.model is None else args.model) in BUILTIN_MODELS:
        model = load_model(DEFAULT_MODEL if args.model is None else args.model)
    else:
        raise ConfigError(f"--model {show(args.model)} is not a built-in model; allowed: {', '.join(BUILTIN_MODELS)} "
                          "(use --config PATH for a config.json)")
    if not 0 < args.cache_fraction <= 1:
        raise ConfigError(f"--cache-fraction must be in (0, 1], got {args.cache_fraction}")
    if args.kv_cache_memory_bytes is not None:
        budget = args.kv_cache_memory_bytes
        if budget < 1:
            raise ConfigError(f"--kv-cache-memory-bytes must be at least 1 byte, got {budget}")
    else:
        budget = int(args.gpu_memory * args.cache_fraction)
    options = dict(
        kv_cache_dtype=args.kv_cache_dtype,
        indexer_kv_dtype="auto" if args.attention_config is None else parse_attention_config(args.attention_config),
        speculative=None if args.speculative_config is None else SpeculativeConfig.from_json(args.speculative_config),
        prefill_context_parallel_size=args.prefill_context_parallel_size,
        decode_context_parallel_size=args.decode_context_parallel_size,
        cp_kv_cache_interleave_size=args.cp_kv_cache_interleave_size,
        target_arch=args.target_arch,
        indexer_backend=args.indexer_backend,
        reference_tp=args.reference_tp,
        cache_memory_bytes=budget,
    )
    return [CacheConfig.from_model(model, tensor_parallel_size=tp, **options) for tp in args.tensor_parallel_size]


def cmd_plan(args: argparse.Namespace) -> int:
    """``dsacache plan``: the report, the TP table or JSON, and the optional plot."""
    from dsacache.planner import plan
    from dsacache.planner.report import exchange_table, render_text, render_tp_table, summarize

    if args.plot is not None:
        from dsacache.planner.plot import check_plot_path, plot_layout

        check_plot_path(args.plot)
    layouts = [plan(c) for c in configs_from_args(args)]
    summaries = [summarize(layout, args.context_length) for layout in layouts]
    if args.plot is not None:
        others = [s["tensor_parallel_size"] for s in summaries[1:]]
        plot_layout(layouts[0], summaries[0], args.plot, not_drawn=others)
        if others:
            print(f"note: --plot draws TP {summaries[0]['tensor_parallel_size']} only (the first of the list)",
                  file=sys.stderr)
    if args.json:
        print(json.dumps(summaries[0] if len(summaries) == 1 else summaries, indent=2))
    elif len(summaries) == 1:
        print(render_text(summaries[0]))
    else:
        print(render_tp_table(summaries, exchange_table(layouts)))
    if args.plot is not None:
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    """``dsacache simulate``."""
    from dsacache.cli.simulate import run

    return run(args, configs_from_args(args))


def build_parser() -> argparse.ArgumentParser:
    """The ``dsacache`` argument parser with its subcommands."""
    parser = ArgumentParser(prog="dsacache", description="The packed DSA cache for hybrid sparse-attention LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan the packed cache of a model and report capacity and waste")
    add_model_arguments(p)
    p.add_argument("--context-length", "--max-model-len", type=int, default=DEFAULT_CONTEXT_LENGTH, metavar="N",
                   help=f"request length for the concurrency figure (default {DEFAULT_CONTEXT_LENGTH})")
    p.add_argument("--json", action="store_true", help="print one JSON object (a list for a TP list)")
    p.add_argument("--plot", metavar="FILE", help="draw the row layout and capacity to FILE, a .png, .svg or .pdf "
                                                  "(needs matplotlib)")
    p.set_defaults(func=cmd_plan)
    s = sub.add_parser("simulate", help="replay a synthetic request stream through the row allocator (CPU)")
    add_model_arguments(s)
    from dsacache.cli.simulate import add_arguments as add_sim_arguments

    add_sim_arguments(s)
    s.set_defaults(func=cmd_simulate)
    # listed for --help only: main() hands everything after "bench" to dsacache.bench untouched
    sub.add_parser("bench", help="time the GPU kernels (same as python -m dsacache.bench; "
                                 "dsacache bench --help lists the suites)", add_help=False)
    parser.subcommands = {"plan": p, "simulate": s}
    return parser


def _run(argv: list[str]) -> int:
    if argv[:1] == ["bench"]:
        from dsacache.bench.__main__ import main as bench_main

        return bench_main(argv[1:])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the subcommand, so that the hint points at its --help
        parser.subcommands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args.func(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0, 2 for a bad setting, 141 for a closed output pipe).

    A bad setting prints one ``dsacache: error: ...`` line on stderr; ``--help`` returns 0.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        status = _run(argv)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return status
    except SystemExit as exc:  # argparse: --help (0) or an argument error already printed (2)
        return exc.code if isinstance(exc.code, int) else 2
    except BrokenPipeError:
        _drop_stdout()
        return EXIT_BROKEN_PIPE
    except (ValueError, NotImplementedError) as exc:  # ConfigError is a ValueError
        return _fail(str(exc))
    except RecursionError:
        return _fail("input nested too deeply")
    except MemoryError:
        return _fail("out of memory")
    except KeyboardInterrupt:
        return 130


def _fail(message: str) -> int:
    """Print one error line (even if the message had several) and return 2."""
    with contextlib.suppress(BrokenPipeError):  # stderr closed as well: no one is left to tell
        print(f"dsacache: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def _drop_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a file descriptor (captured in-process): nothing is flushed at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
