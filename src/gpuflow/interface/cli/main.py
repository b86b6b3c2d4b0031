"""The parser of every command, and what ``main`` makes of what a command raises."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable

from gpuflow.common.errors import GpuflowError, InterruptedAndSaid
from gpuflow.interface.cli import bench, export, info, prepare, profile, sample, train
from gpuflow.interface.cli.common import EXIT_BAD_INPUT, EXIT_INTERRUPTED

COMMANDS = (info, prepare, train, bench, profile, sample, export)  # in --help's order


def build_parser() -> argparse.ArgumentParser:
    from gpuflow import __version__

    parser = argparse.ArgumentParser(
        prog="gpuflow",
        description="GPU-resident PyTorch training that moves across the host-device bus "
        "only what must cross.",
    )
    parser.add_argument("--version", action="version", version=f"gpuflow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def _parser_of(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The (sub)command parser that ``args`` were parsed by, the deepest one chosen."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(args, action.dest, None)
            if chosen in action.choices:
                return _parser_of(action.choices[chosen], args)
    return parser


def _refuse_unknown(parser: argparse.ArgumentParser, extras: list[str]) -> None:
    """argparse's error for arguments no option takes, naming the option meant where one is
    close (``--vocab_size`` for ``--vocab-size``, ``--max-new-tokens`` for ``--max-tokens``)."""
    from gpuflow.train.config import section_keys
    from gpuflow.train.config_hints import NANOGPT_NAMES, nanogpt_hint

    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for extra in extras:
        name = extra.split("=", 1)[0]
        if not name.startswith("--"):
            continue
        close = difflib.get_close_matches(name.replace("_", "-"), options, n=1, cutoff=0.75)
        nanogpt = name[2:].replace("-", "_")
        if close:
            hints.append(f"{name}: did you mean {close[0]}?")
        elif not parser.prog.endswith(" train"):
            continue
        elif nanogpt in NANOGPT_NAMES:
            ours = NANOGPT_NAMES[nanogpt].split()[0]  # "train.lr", "--resume", "-:"
            how = f" (--set {ours}=VALUE)" if "." in ours and not ours.startswith("-") else ""
            hints.append(f"{name}: {nanogpt_hint(nanogpt)}{how}")
        elif owners := [s for s, keys in section_keys().items() if nanogpt in keys]:
            hints.append(f"{name}: a setting here, given as --set {owners[0]}.{nanogpt}=VALUE")
    parser.error(f"unrecognized arguments: {' '.join(extras)}" + "".join(f"; {h}" for h in hints))


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except KeyboardInterrupt:  # Ctrl-C while the commands load
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    args, extras = parser.parse_known_args(argv)
    if extras:
        _refuse_unknown(_parser_of(parser, args), extras)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # to start again with (allocator)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except GpuflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:  # a fault of the machine that no command turned into its own line
        from gpuflow.common.oserrors import describe_os_error

        print(f"error: {describe_os_error(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:
        torch = sys.modules.get("torch")  # loaded by any command that could run out
        if torch is None or not isinstance(exc, torch.OutOfMemoryError):
            raise
        from gpuflow.device.accelerator import out_of_memory_figures

        print(
            f"error: out of device memory ({out_of_memory_figures(exc)}); lower the batch "
            "size, sequence length or model size",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as exc:
        if not isinstance(exc, InterruptedAndSaid):
            print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
