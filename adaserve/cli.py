"""The `adaserve` command: one entry point, one module per subcommand.

Subcommand modules are imported only when chosen, so `adaserve select` never pays for
torch and `adaserve --help` is instant. Each module exposes
`add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "select": ("adaserve.commands.select", "run token selection on a JSON batch"),
    "scheduler": ("services.scheduler.__main__", "run the scheduler gRPC service"),
    "drafter": ("services.drafter.__main__", "run the drafter gRPC service"),
    "verifier": ("services.verifier.__main__", "run the verifier gRPC service (engine)"),
    "gateway": ("gateway.__main__", "run the OpenAI-compatible gateway"),
    "generate": ("adaserve.commands.generate", "speculative generation for one prompt"),
    "up": ("adaserve.commands.up", "start all services locally"),
    "distill": ("adaserve.commands.distill", "train a drafter for a target model"),
    "measure-drafter": (
        "adaserve.commands.measure_drafter",
        "drafter acceptance and cost vs its target",
    ),
    "profile": ("adaserve.commands.profile", "measure a hardware profile"),
    "simulate": ("adaserve.commands.simulate", "trace-driven simulation"),
    "capacity": ("adaserve.commands.capacity", "serving units a workload needs at its SLOs"),
    "bench": ("adaserve.commands.bench", "benchmarks against a running server"),
    "demo": ("adaserve.commands.demo", "drive a running server with a mixed SLO workload"),
    "fuzz": ("adaserve.commands.fuzz", "speculative vs plain decoding on random API requests"),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each option's default (options without help text included),
    except where there is none to show (None, an unset flag, an empty list) or the help
    text already says it."""

    def add_argument(self, action: argparse.Action) -> None:
        if action.help is None and action.option_strings and _has_default(action):
            action = copy.copy(action)  # the parser's own action stays as it is
            action.help = "(default: %(default)s)"
        super().add_argument(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or "").lower() or not _has_default(action):
            return action.help
        return super()._get_help_string(action)


def _has_default(action: argparse.Action) -> bool:
    d = action.default
    return not (d is None or d is False or d is argparse.SUPPRESS or d == [])


def _usage() -> str:
    lines = ["usage: adaserve COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<10} {desc}" for name, (_, desc) in COMMANDS.items()]
    lines += ["", "`adaserve COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from adaserve import __version__

        print(__version__)
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"adaserve: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, desc = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(f"adaserve: command {name!r} is not available in this build", file=sys.stderr)
            return 2
        raise
    parser = argparse.ArgumentParser(
        prog=f"adaserve {name}", description=desc, formatter_class=HelpFormatter
    )
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
