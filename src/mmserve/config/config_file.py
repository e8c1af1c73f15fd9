"""`mmserve serve --config FILE.yaml`: flags read from a YAML file, as vLLM's `--config`.

The file maps flag names (their long form, `max-num-seqs` or `max_num_seqs`) to values. Each
becomes the command-line words it stands for, placed before the command line's own, so a flag given
on both wins from the command line (vLLM's order: command line > config file > defaults):

- `true` / `false` for a switch: the flag, or nothing (`--no-flag` where the switch has one);
- a list: the flag once with every item where it takes several values (`served-model-name`), once
  per item where it repeats (`middleware`), else the list as JSON;
- a mapping: JSON (`mm-processor-kwargs: {max_pixels: 1003520}`);
- anything else: its text.

A key that names no flag, a value of the wrong shape, or a file that is not a mapping is a
ValueError naming the file and the key, before anything loads.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

FLAG = "--config"


def config_file_words(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The command-line words `path` stands for, for `parser`'s flags."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"{FLAG} {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{FLAG} {path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"{FLAG} {path}: must map flag names to values (e.g. 'max-num-seqs: 8')")
    actions = {s[2:]: a for a in parser._actions for s in a.option_strings if s.startswith("--")}
    words: list[str] = []
    for key, value in data.items():
        name = str(key).replace("_", "-")
        action = actions.get(name)
        if action is None or name == FLAG[2:]:
            raise ValueError(f"{FLAG} {path}: {key!r} is not a flag of this command")
        words += _words(action, "--" + name, value, f"{FLAG} {path}: {key}")
    return words


def _words(action: argparse.Action, flag: str, value: Any, where: str) -> list[str]:
    if action.nargs == 0:  # a switch: store_true, or BooleanOptionalAction's --flag / --no-flag
        if not isinstance(value, bool):
            raise ValueError(f"{where} is a switch: true or false; got {value!r}")
        if value:
            return [flag]
        return ["--no-" + flag[2:]] if isinstance(action, argparse.BooleanOptionalAction) else []
    if value is None:
        raise ValueError(f"{where} has no value (leave the key out for the default)")
    if isinstance(value, list) and action.nargs in ("+", "*"):
        return [flag, *(_text(v) for v in value)]
    if isinstance(value, list) and isinstance(action, (argparse._AppendAction, argparse._ExtendAction)):
        return [w for v in value for w in (flag, _text(v))]
    return [flag, _text(value)]


def _text(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def with_config_file(parser: argparse.ArgumentParser, subparser: argparse.ArgumentParser,
                     argv: list[str]) -> argparse.Namespace:
    """`argv` parsed by `parser`, with the words of the file `subparser`'s `--config` names (when
    given) placed before the subcommand's own."""
    args = parser.parse_args(argv)
    path = getattr(args, "config", None)
    if path is None:
        return args
    at = argv.index(args.command)
    return parser.parse_args([*argv[:at + 1], *config_file_words(subparser, path), *argv[at + 1:]])
