"""YAML run files: every flag of a script's argparse parser as a key of the same name.

The schema is the parser itself, so a flag added to a script is a run-file key with no edit here:
its type, choices and default decide what the key accepts. Keys may sit in sections (`lora: {rank:
16}` is `--lora-rank 16`); flags on the command line override the file. Writes the resolved run back.
"""
from __future__ import annotations

import argparse
import difflib
import math
from pathlib import Path

import yaml

from phantom.base import fileio

RECORDED = "recorded"  # the section a resolved run file keeps its versions and store fingerprint in
SKIP = {"help", "config", "sweep"}  # flags that are not a run file's keys (a file lists `adapters:` itself)
ADAPTERS = "adapters"  # the top-level list of a sweep's adapters (phantom.train.runconfig.checked_adapters)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last, silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read(path: str | Path) -> dict:
    """The run file as a mapping; a file that is not YAML, or not a mapping, is one ValueError."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"--config: {path} is a folder, not a run file")
    if not path.is_file():
        raise FileNotFoundError(f"--config: run file {path} not found")
    try:
        doc = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a YAML run file (not UTF-8 text: {e.reason})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
        what = getattr(e, "problem", None) or str(e)
        raise ValueError(f"{path}:{where} malformed YAML ({what})") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a run file is a mapping of flag names to values, not a {type(doc).__name__}")
    return doc


def schema(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Run-file key (a long flag without its dashes) -> the parser's action for it."""
    keys = {}
    for action in parser._actions:  # argparse keeps no public list of its actions
        if action.dest in SKIP:
            continue
        for opt in action.option_strings:
            if opt.startswith("--") and not (isinstance(action, argparse.BooleanOptionalAction)
                                             and opt.startswith("--no-")):
                keys.setdefault(opt[2:], action)
    return keys


def resolve_key(keys: dict, section: str | None, key: str) -> str | None:
    """The flag a key names: in section S, `S-key` if that is a flag, else `key` itself."""
    key = str(key).replace("_", "-")
    if section is not None and f"{section}-{key}" in keys:
        return f"{section}-{key}"
    return key if key in keys else None


def flatten(doc: dict, keys: dict, sections: tuple[str, ...], path: Path) -> dict[str, tuple[str, object]]:
    """flag -> (the key as written, its value); sections opened, unknown keys and repeats refused."""
    found: dict[str, tuple[str, object]] = {}
    for top, value in doc.items():
        if top in (RECORDED, ADAPTERS):
            continue
        if top in sections and isinstance(value, dict):
            items = [(f"{top}.{k}", resolve_key(keys, top, k), v) for k, v in value.items()]
        else:
            items = [(str(top), resolve_key(keys, None, top), value)]
        for written, flag, v in items:
            if flag is None:
                raise ValueError(f"{path}: unknown key {written!r}{suggest(written, keys, sections)}")
            if flag in found:
                raise ValueError(f"{path}: {written!r} and {found[flag][0]!r} both set --{flag}")
            found[flag] = (written, v)
    return found


def suggest(written: str, keys: dict, sections: tuple[str, ...]) -> str:
    known = list(keys) + [f"{s}.{k[len(s) + 1:]}" for s in sections for k in keys if k.startswith(s + "-")]
    close = difflib.get_close_matches(written.replace("_", "-"), known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else " (run files take the script's flags, see --help)"


def values(doc: dict, parser: argparse.ArgumentParser, path: Path, sections: tuple[str, ...] = ()) -> dict:
    """dest -> value for every key of the run file, checked as the command line checks its flags."""
    keys = schema(parser)
    out = {}
    for flag, (written, value) in flatten(doc, keys, sections, path).items():
        action = keys[flag]
        try:
            converted = convert(action, value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            raise ValueError(f"{path}: {written}: {e}") from None
        if converted is not _UNSET:
            out[action.dest] = converted
    return out


_UNSET = object()  # `flag: false` for a flag that takes no value: as if it were not given


def convert(action: argparse.Action, value):
    """A YAML value as the action would store it from the command line, or TypeError/ValueError."""
    if value is None and action.default is None:  # null: not given, the config decides (auto)
        return None
    if action.nargs == 0:  # store_true/false/const and --x/--no-x pairs
        if not isinstance(value, bool):
            raise TypeError(f"expected true or false, got {describe(value)}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return value
        return action.const if value else _UNSET
    if value is None:
        raise TypeError(f"expected {expected(action)}, got null")
    if action.nargs in ("*", "+") or isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [check_choice(action, scalar(action, v)) for v in items]
    if isinstance(value, list) and action.type is None and "comma" in (action.help or ""):
        value = ",".join(scalar(action, v) for v in value)  # targets: [q, v] reads as --lora-targets q,v
    return check_choice(action, scalar(action, value))


def scalar(action: argparse.Action, value):
    kind = action.type
    if isinstance(value, (dict, list)):
        raise TypeError(f"expected {expected(action)}, got {describe(value)}")
    if kind is None:  # a string flag: numbers read as written (prefetch: 2), booleans are YAML's on/yes trap
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise TypeError(f"expected a string, got {describe(value)} (quote it)")
        return str(value)
    if isinstance(value, str):
        try:
            return kind(value)  # as the command line converts it: '1e-4', '64G', 'auto'
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            raise ValueError(f"expected {expected(action)}, got {value!r}" + (f": {e}" if kind not in (int, float)
                                                                             else "")) from None
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(f"expected an integer, got {describe(value)}")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise TypeError(f"expected a number, got {describe(value)}")
    if kind in (int, float):
        return kind(value)
    text = str(value).lower() if isinstance(value, bool) else str(value)
    try:
        return kind(text)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        raise ValueError(f"expected {expected(action)}, got {describe(value)}: {e}") from None


def check_choice(action: argparse.Action, value):
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"expected one of {', '.join(map(str, action.choices))}, got {value!r}")
    return value


def expected(action: argparse.Action) -> str:
    if action.choices is not None:
        return "one of " + ", ".join(map(str, action.choices))
    return {None: "a string", int: "an integer", float: "a number"}.get(action.type, action.metavar or "a value")


def describe(value) -> str:
    if value is None:
        return "null"
    kind = {bool: "a boolean", dict: "a mapping", list: "a list", int: "an integer", float: "a number",
            str: "a string"}.get(type(value), type(value).__name__)
    return f"{value!r} ({kind})" if not isinstance(value, (dict, list)) else kind


def parse_args(parser: argparse.ArgumentParser, argv=None, sections: tuple[str, ...] = ()) -> argparse.Namespace:
    """Parse `argv`; with `--config FILE`, the file's values become the defaults the flags override."""
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is None:
        return args
    path = Path(args.config)
    doc = read(path)
    listed = {ADAPTERS: doc[ADAPTERS]} if ADAPTERS in doc else {}  # a sweep's adapters (RunConfig.adapters)
    parser.set_defaults(**values(doc, parser, path, sections), **listed)
    return parser.parse_args(argv)


def recorded(path: str | Path | None) -> dict:
    """The `recorded:` section of a run file (versions, store fingerprint), or {}."""
    if path is None:
        return {}
    section = read(path).get(RECORDED)
    return section if isinstance(section, dict) else {}


def given(parser: argparse.ArgumentParser, argv=None) -> set[str]:
    """The dests the command line itself sets (not their defaults)."""
    saved = [(a, a.default) for a in parser._actions]
    try:
        for a, _ in saved:
            a.default = argparse.SUPPRESS
        return set(vars(parser.parse_args(argv)))
    finally:
        for a, default in saved:
            a.default = default


def settings(parser: argparse.ArgumentParser, args: argparse.Namespace, **override) -> dict[str, object]:
    """flag -> value of every flag of a run (one flag per dest), `override` (by dest) applied."""
    out, seen = {}, set()
    for key, action in schema(parser).items():
        if action.dest in seen:
            continue
        seen.add(action.dest)
        value = override.get(action.dest, getattr(args, action.dest, None))
        if action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction):
            value = value == action.const  # true: the flag was in effect
        out[key] = plain(value)
    return out


def plain(value):
    """A value YAML writes and reads back as the same thing (a Path becomes its text)."""
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return str(value)


def dump(parser: argparse.ArgumentParser, flat: dict[str, object], sections: dict[str, tuple[str, ...]],
         record: dict | None = None, header: str = "") -> str:
    """YAML text of a run: each flag in its section (short key where it reads back the same), then
    the `recorded:` section."""
    keys = schema(parser)
    doc: dict = {}
    for flag, value in flat.items():
        section = next((s for s, flags in sections.items() if flag in flags), None)
        section = section or next((s for s in sections if flag == s or flag.startswith(s + "-")), None)
        short = flag[len(section) + 1:] if section and flag.startswith(section + "-") else flag
        if section and resolve_key(keys, section, short) == flag:
            doc.setdefault(section, {})[short] = value
        elif section and resolve_key(keys, section, flag) == flag:
            doc.setdefault(section, {})[flag] = value
        else:
            doc[flag] = value
    if record:
        doc[RECORDED] = {k: plain(v) for k, v in record.items()}
    return header + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, allow_unicode=True, width=100)


def write(path: Path, text: str) -> None:
    fileio.atomic_write_text(path, text)


def as_argv(parser: argparse.ArgumentParser, dests: dict) -> list[str]:
    """Command-line arguments that set each dest to its value (for the run card's command)."""
    argv, seen = [], set()
    for key, action in schema(parser).items():
        if action.dest not in dests or action.dest in seen:
            continue
        seen.add(action.dest)
        value, flag = dests[action.dest], f"--{key}"
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else f"--no-{key}")
        elif action.nargs == 0:
            argv += [flag] if value == action.const else []
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv
