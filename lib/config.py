"""The one configuration surface: every key declared once in lib/settings.py (TRL's names, help, choices and
ranges), loadable from YAML, overridable on the command line, checked right after parsing, and saved with every run
and checkpoint.

    python train_agrpo.py --config recipe.yaml --learning_rate 1e-5 --use_peft true

Precedence: dataclass defaults < the `algo` preset (lib/methods/registry.py) < the YAML file < the command line. A key that is
not a field is an error that names the closest field (TRL's and open-r1's keys: lib/trl_keys.py, which the
entry scripts pass as `keys`); an invalid value is an error that names the field and the fix: each field's choices
and range in one loop (`check_fields`), then the checks that span several keys (`validate`, each method's own in
lib/methods/registry.py, the loss type's in lib/methods/losses.py). eval_agrpo.py reads the keys it shares with the
trainer through the same parser set-up, reader and checks (`shared_sections`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import importlib.util
import math
import os
import sys
import types
import typing
from pathlib import Path

import torch
import yaml
from transformers import HfArgumentParser

from lib.data.records import looks_local
from lib.methods.losses import check_settings
from lib.methods.registry import METHODS
from lib.rewards.scoring import object_spec
from lib.schedule import schedule_options, steps_per_rollout
from lib.settings import (EMBEDDED_MODEL, FIELDS, PRESETS, SECRET_KEYS, SECTIONS, Config,
                          ConfigError)

# ---- reading: YAML recipes and the command line ----------------------------------------------------------------------


@functools.cache
def _type_hints() -> dict:
    """The fields' resolved types, computed once (resolving them per field cost about 2 s per parse)."""
    return typing.get_type_hints(Config)


def _field_type(name: str):
    hint = _type_hints()[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return args[0] if len(args) == 1 else hint, True
    return hint, False


def _type_name(typ) -> str:
    return getattr(typ, "__name__", str(typ))


def as_bool(value) -> bool:
    """A YAML or command-line boolean (true / 1 / yes / on, false / 0 / no / off, any case); ValueError otherwise."""
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text not in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        raise ValueError(value)
    return text in ("true", "1", "yes", "on")


def _scalar(name: str, typ, value):
    """One value of a bool, int, float or str field, from YAML or from the command line's text. Refused: a bool where
    a number or a text is expected (YAML reads `yes` / `no` / `on` as booleans), a list or a mapping where one value
    is expected, a fractional number for an int. Non-finite floats pass here; `validate` names them."""
    if isinstance(value, (dict, list, tuple, set)):
        raise ConfigError(f"{name}: expected one {_type_name(typ)}, got a {type(value).__name__} ({value!r:.80}); "
                          f"give a single value")
    if typ is str and callable(value):  # a Python user's function or class (tools, rollout_func): recorded by name
        try:
            return object_spec(value, "rollout_func" if name == "rollout_func" else "tool")
        except ValueError as error:
            raise ConfigError(f"{name}: {error}") from None
    if typ is bool:
        return as_bool(value)
    if isinstance(value, bool):
        quote = "; write it in quotes in YAML" if typ is str else ""
        article = "an" if typ is int else "a"
        raise ConfigError(f"{name}: expected {article} {_type_name(typ)}, got the boolean {str(value).lower()}{quote}")
    if typ is int:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return int(value)
    if typ is float:
        return float(value)
    return str(value)


def _coerce(name: str, value):
    """Turn a YAML or command-line value into the field's type, or raise ConfigError naming the field."""
    typ, optional = _field_type(name)
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and optional):
        if optional:
            return None
        raise ConfigError(f"{name} cannot be null; give a {_type_name(typ)}")
    origin = typing.get_origin(typ)
    if isinstance(typ, types.UnionType) and set(typing.get_args(typ)) >= {str, dict}:  # a spec, or names -> specs
        return _spec_or_mapping(name, value)
    try:
        if typ is dict:  # a mapping (generation_kwargs, chat_template_kwargs): YAML, or JSON text on the command line
            try:
                mapping = yaml.safe_load(value) if isinstance(value, str) else value
            except yaml.YAMLError:
                mapping = None
            if not isinstance(mapping, dict) or not all(isinstance(k, str) for k in mapping):
                raise ConfigError(f"{name}: expected a mapping of names to values, got {value!r:.80}; give one in "
                                  f"YAML, or as JSON on the command line ('{{\"key\": value}}')")
            return dict(mapping)
        if origin is list and typing.get_args(typ)[0] is dict:  # structured (resample_schedule): YAML or JSON text
            try:
                items = yaml.safe_load(value) if isinstance(value, str) else value
            except yaml.YAMLError as error:
                problem = getattr(error, "problem", None) or "not YAML or JSON"
                raise ConfigError(f"{name}: cannot read {value!r:.80} ({problem}); give a list of mappings, in YAML "
                                  f"or as JSON on the command line") from None
            if not isinstance(items, list) or not all(isinstance(v, dict) for v in items):
                raise ValueError(value)
            return [dict(v) for v in items]
        if origin is list:
            inner = typing.get_args(typ)[0]
            if isinstance(value, dict):
                raise ValueError(value)
            items = value if isinstance(value, list) else [v for v in str(value).replace(",", " ").split() if v]
            return [_scalar(name, inner, v) for v in items]
        return _scalar(name, typ, value)
    except (TypeError, ValueError, OverflowError) as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"{name}: cannot read {value!r:.80} as {_type_name(typ)}") from None


def _spec_or_mapping(name: str, value):
    """A field that takes one spec ('module:Class') or a mapping of names to specs (environment_factory): from YAML as
    it is, from the command line as the spec, or as a mapping in YAML / JSON text."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(f"{name}: cannot read {value!r:.80} as a mapping; give one as JSON "
                              "('{\"name\": \"module:Class\"}') or a single module:Class") from None
    def spec(entry):  # a Python user's class itself: recorded by name (config.yaml holds the spec)
        try:
            return object_spec(entry, "environment") if isinstance(entry, type) else entry
        except ValueError as error:
            raise ConfigError(f"{name}: {error}") from None

    if isinstance(value, type):
        return spec(value)
    if isinstance(value, dict):
        bad = [k for k, v in value.items() if not isinstance(k, str)
               or not (isinstance(v, type) or isinstance(v, str) and v.strip())]
        if bad or not value:
            raise ConfigError(f"{name}: a mapping gives each name a 'module:Class' or 'file.py:Class' spec, got "
                              f"{value!r:.80}")
        return {k: spec(v) for k, v in value.items()}
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise ConfigError(f"{name}: expected 'module:Class' / 'file.py:Class' or a mapping of names to them, got "
                      f"{value!r:.80}")


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml's safe loader, refusing a key given twice in one mapping (yaml itself keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):
                continue  # the base class refuses it with its own message
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice (keep one)",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _mark(mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def load_yaml(path: str) -> dict:
    """The mapping of a YAML recipe; ConfigError names the file (and the line and column of a syntax error) and the
    fix for a file that is missing, unreadable, not UTF-8, not YAML, or not a mapping of keys to values."""
    file = Path(path)
    try:
        if not file.exists():
            raise ConfigError(f"config: the file '{path}' does not exist; pass the path of a YAML recipe")
        if file.is_dir():
            raise ConfigError(f"config: '{path}' is a folder; pass the path of a YAML recipe file")
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"config: '{path}' is not UTF-8 text (byte {error.start}: {error.reason}); save the recipe "
                          f"as UTF-8") from None
    except (OSError, ValueError) as error:  # permission denied, a name the OS refuses (ConfigError passes through)
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"config: cannot read '{path}' ({error.strerror if isinstance(error, OSError) else error}); "
                          f"pass a readable YAML recipe file") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: plain YAML types only, no Python objects
    except yaml.MarkedYAMLError as error:
        where = f", {_mark(error.problem_mark)}" if error.problem_mark else ""
        context = ""
        if error.context:
            started = f" at {_mark(error.context_mark)}" if error.context_mark else ""
            context = f" ({error.context}{started})"
        problem = error.problem or "invalid YAML"
        raise ConfigError(f"config: '{path}'{where}: {problem}{context}; fix the YAML there (a recipe is lines of "
                          f"'key: value')") from None
    except yaml.reader.ReaderError as error:  # a control character yaml refuses anywhere
        line = text.count("\n", 0, error.position) + 1
        column = error.position - (text.rfind("\n", 0, error.position) + 1) + 1
        raise ConfigError(f"config: '{path}', line {line}, column {column}: the character {chr(error.character)!r} "
                          f"is not allowed in YAML; remove it") from None
    except yaml.YAMLError as error:
        reason = " ".join(str(error).split())
        raise ConfigError(f"config: '{path}' is not valid YAML ({reason}); fix the file") from None
    if data is None:  # an empty file, or only comments
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: '{path}' must hold a mapping of keys to values (lines of 'key: value'), but its "
                          f"top level is a {type(data).__name__}")
    bad_keys = [key for key in data if not isinstance(key, str)]
    if bad_keys:
        raise ConfigError(f"config: '{path}': the key {bad_keys[0]!r} is not a name; keys are field names such as "
                          f"learning_rate (see `python train_agrpo.py --help`)")
    return data


def help_only(section: type) -> type:
    """A section as HfArgumentParser is given it: it passes every metadata key but `aliases` (more flags of the key)
    to argparse's add_argument, which takes `help` and `choices` and refuses the rest, and would refuse a bad choice
    itself, without the field's fix; choices and ranges are `check_fields`' instead."""
    fields = [(f.name, f.type, dataclasses.field(default=f.default, default_factory=f.default_factory,
                                                 metadata={k: f.metadata[k] for k in ("help", "aliases")
                                                           if k in f.metadata}))
              for f in dataclasses.fields(section) if f.name in vars(section).get("__annotations__", {})]
    return dataclasses.make_dataclass(section.__name__, fields, namespace={
        "_argument_group_name": section._argument_group_name, "__module__": section.__module__})


def build_parser() -> HfArgumentParser:
    """transformers' HfArgumentParser over the sections (one --help section each; `--flag` alone means true, as in
    TRL), with every default set to 'not given' so that precedence stays explicit. Values stay text here and are
    read by `_coerce`, the same reader a YAML recipe goes through."""
    # no abbreviations: argparse would read `--lr 1e-5` as --lr_scheduler_type 1e-5
    parser = HfArgumentParser([help_only(section) for section in SECTIONS], description="GRPO and adaptive "
                              "variants, one visible training loop. Keys follow TRL's GRPOConfig / ModelConfig / "
                              "ScriptArguments; a TRL or open-r1 recipe runs as it is (docs/configuration.md).",
                              allow_abbrev=False)
    parser.add_argument("--config", help="YAML recipe; command-line flags override its values.",
                        default=argparse.SUPPRESS)
    read_as_fields(parser, FIELDS)
    return parser


def read_as_fields(parser: argparse.ArgumentParser, fields: dict[str, dataclasses.Field]) -> None:
    """The parser's actions of `fields` made to read as the trainer reads them: the help ends with the range and the
    default, the default is 'not given' (the caller fills it in: precedence stays explicit), and the value stays text
    for `_coerce`, the reader a YAML recipe goes through too; `--flag` alone means true, as in TRL."""
    for action in parser._actions:
        if action.dest not in fields:
            continue
        if action.option_strings[0].startswith("--no_"):  # HfArgumentParser's `--no_<key>` for a key true by default
            action.default = argparse.SUPPRESS
            continue
        f = fields[action.dest]
        accepts = f" Range: {f.metadata['range']}." if "range" in f.metadata else ""
        action.help = f"{action.help or ''}{accepts} (default: {default_of(f)})".replace("%", "%%")
        action.default = argparse.SUPPRESS
        action.type = None  # `_coerce` reads every value, from YAML or the command line alike
        action.metavar = action.dest.upper()
        typ, _ = _field_type(action.dest)
        if typ is bool:  # `--use_peft` alone is true; `--use_peft false` still reads
            action.nargs, action.const = "?", True
        elif typ is dict or (typing.get_origin(typ) is list and typing.get_args(typ)[0] is dict):
            action.nargs = None  # one YAML / JSON text


def default_of(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def setting(settings, key: str):
    """The trainer's key `key` as `settings` give it: a run's Config, or an entry script's arguments (eval_agrpo.py,
    chat_app.py), which declare only the keys they take from the command line; a key they do not declare has the
    trainer's default (lib/settings.py). The builders the three scripts share read their keys through it."""
    return getattr(settings, key) if hasattr(settings, key) else default_of(FIELDS[key])


# ---- the trainer's keys in another entry script (eval_agrpo.py) ------------------------------------------------------


TRAINERS_DEFAULT = object()  # Differs.default when only something else differs


@dataclasses.dataclass(frozen=True)
class Differs:
    """How an entry script that shares the trainer's keys declares one of them otherwise, and why (`because`, added
    to the key's help). `several`: a list of values (`--key v1 v2`), each read and checked as the trainer reads one;
    its default, unless given, is the trainer's default as a list. `range` and `why`: as in lib/settings.py."""

    because: str
    default: object = TRAINERS_DEFAULT
    several: bool = False
    range: str | None = None
    why: str | None = None


def shared_sections(names, differs: dict[str, Differs], who: str,
                    aliases: dict[str, tuple[str, ...]] | None = None) -> list[type]:
    """lib/settings.py's sections cut down to the keys `names`, in the trainer's order, each titled as the trainer's
    --help titles it: every field keeps its type, help, choices and range (so the other script's --help and checks
    cannot drift from the trainer's), except where `differs` declares it otherwise (`who` names the script in the
    help: "Evaluator: ..."); `aliases`: more flags of a key (the script's older names). Give them to HfArgumentParser
    through `help_only`, then `read_as_fields`."""
    aliases = aliases or {}
    unknown = sorted(set(names) - set(FIELDS)) + sorted((set(differs) | set(aliases)) - set(names))
    if unknown:
        raise ValueError(f"not keys of lib/settings.py shared here: {', '.join(unknown)}")
    cut = []
    for section in SECTIONS:
        fields = []
        for f in dataclasses.fields(section):
            if f.name not in names:
                continue
            typ, meta, default = f.type, dict(f.metadata), default_of(f)
            if f.name in aliases:
                meta["aliases"] = list(aliases[f.name])
            if f.name in differs:
                d = differs[f.name]
                meta["help"] = f"{meta.get('help', '')} {who}: {d.because}."
                meta.update({k: v for k, v in (("range", d.range), ("why", d.why)) if v is not None})
                if d.several:
                    typ, meta["several"] = f"list[{_field_type(f.name)[0].__name__}] | None", True
                    default = default if default is None else [default]
                if d.default is not TRAINERS_DEFAULT:
                    default = d.default
            fields.append((f.name, typ, dataclasses.field(default_factory=lambda v=default: v, metadata=meta)))
        if fields:
            cut.append(dataclasses.make_dataclass(section.__name__, fields, namespace={
                "_argument_group_name": section._argument_group_name, "__module__": section.__module__}))
    return cut


def read_fields(given: dict, fields: dict[str, dataclasses.Field]) -> dict:
    """Each key of `fields`: its value in `given` (command-line text) or its default, read by `_coerce` as the trainer
    reads it (`several`: each item of a list). ConfigError names the key, first, as `check_fields`' do."""
    values = {}
    for name, f in fields.items():
        value = given.get(name, default_of(f))
        if f.metadata.get("several") and value is not None:
            value = [_coerce(name, v) for v in (value if isinstance(value, list) else [value])]
            if value == [None]:  # `--dataset_name null`: the default, as the trainer reads it
                value = None
            elif None in value:
                raise ConfigError(f"{name}: null is one of its values; give values, or null alone for the default")
        else:
            value = _coerce(name, value)
        values[name] = value
    return values


@functools.cache
def _parser() -> HfArgumentParser:
    """The parser, built once (building it takes about 20 ms)."""
    return build_parser()


def flag_before(argv: list[str], at: int) -> int | None:
    """The index of the nearest `--flag` word before argv[at], or None."""
    return next((i for i in range(at - 1, -1, -1) if argv[i].startswith("--")), None)


def leftover_values(words: list[str], argv: list[str], follows: dict[str, str]) -> dict:
    """The flags argparse did not know, as {key: value}: `--key value`, `--key=value`, `--key v1 v2`, or `--key`
    alone (true). They are mistakes, or keys of other projects that parse_config's `keys` reads. An unknown flag that
    follows a known one is named with it (`follows`): it may be a value meant for that flag."""
    values: dict[str, list[str]] = {}
    key = None
    for word in words:
        if word.startswith("--") and len(word) > 2:
            key, eq, value = word[2:].partition("=")
            values[key] = [value] if eq else []
            at = argv.index(word) if word in argv else 0
            flag_at = flag_before(argv, at)
            if flag_at is not None and argv[flag_at][2:].split("=")[0].replace("-", "_") in FIELDS:
                flag, given = argv[flag_at].split("=")[0], at - flag_at - 1 + ("=" in argv[flag_at])
                # `--run_name x --lr`: a flag of its own, or a value meant for the known flag before it
                follows[key] = (f"after {flag} and its value{'s' if given > 1 else ''}" if given else
                                f"after {flag}, a switch that is true when given alone")
        elif key is None:
            flag_at = flag_before(argv, argv.index(word) if word in argv else 0)
            after = f" after {argv[flag_at].split('=')[0]}, which takes one value" if flag_at is not None else ""
            raise ConfigError(f"unexpected argument {word!r:.80} on the command line{after}; flags are written "
                              f"--key value (a list: --key v1 v2; see `python train_agrpo.py --help`)")
        else:
            values[key].append(word)
    return {k: (True if not v else v[0] if len(v) == 1 else v) for k, v in values.items()}


def key_error(key, where: str, follows: dict[str, str] | None = None, known=FIELDS) -> ConfigError:
    """The error for a key that is not a name, or names no field: the closest of `known` is suggested (`where`: the
    YAML file or the command line; `follows`: where an unknown flag stood, from `leftover_values`)."""
    if not isinstance(key, str):
        return ConfigError(f"the key {key!r} in {where} is not a name; keys are field names such as learning_rate")
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else " See `python train_agrpo.py --help` for the keys."
    after = f", {follows[key]}" if follows and key in follows else ""
    return ConfigError(f"unknown configuration key {key!r} ({where}{after}).{hint}")


def field_values(values: dict, where: str, follows: dict[str, str] | None = None) -> dict:
    """`values` as they are when every key is a field; `key_error` otherwise. The default `keys` of parse_config and
    make_config; lib/trl_keys.resolve_keys also reads TRL's and open-r1's keys."""
    for key in values:
        if not isinstance(key, str) or key not in FIELDS:
            raise key_error(key, where, follows)
    return dict(values)


def parse_config(argv: list[str] | None = None, *, check_installed: bool = True, keys=field_values) -> Config:
    """Defaults < algo preset < YAML < command line, then `validate` (`check_installed`: as `validate` takes it).
    keys(values, where, follows): the values of our fields from those given (`field_values`, or
    lib/trl_keys.resolve_keys, which the entry scripts pass, for TRL's and open-r1's keys as well)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    known, rest = _parser().parse_known_args(argv)  # a malformed flag: argparse's one-line error and exit status 2
    args = vars(known)
    values = keys(load_yaml(args.pop("config")), "the YAML config") if "config" in args else {}
    follows: dict[str, str] = {}  # an unknown flag -> where it stands (after which known flag)
    command_line = keys({**args, **leftover_values(rest, argv, follows)}, "the command line", follows)
    return make_config({**values, **command_line}, check_installed=check_installed, keys=keys)  # command line wins


def make_config(values: dict, *, check_installed: bool = True, keys=field_values) -> Config:
    """A validated Config from a dict of field values (`keys` as parse_config takes it; the preset of `algo` fills
    the keys not given)."""
    values = keys(values, "the configuration")
    algo = str(values.get("algo", "grpo"))
    if algo not in PRESETS:
        raise ConfigError(f"algo: {algo!r:.80} is not a preset; choose one of {', '.join(PRESETS)}")
    merged = {**PRESETS[algo], **values}
    if values.get("num_train_epochs") is not None and "max_steps" not in values:
        # TRL's max_steps defaults to -1, so a recipe that gives epochs and no steps trains those epochs; the 40 steps
        # are the no-argument demo's length, not a cap on a recipe
        merged["max_steps"] = -1
    cfg = Config(**{k: _coerce(k, v) for k, v in merged.items()})
    validate(cfg, check_installed=check_installed)
    return cfg


# ---- checks ----------------------------------------------------------------------------------------------------------


def _inside(value, interval: str) -> bool:
    """Whether `value` lies in an interval written as in mathematics: "(0, 1]", "[1, inf)"."""
    low, high = (float(v) for v in interval[1:-1].split(","))
    above = low <= value if interval[0] == "[" else low < value
    below = value <= high if interval[-1] == "]" else value < high
    return above and below


def _bound_text(name: str, interval: str) -> str:
    """The bound a value broke, in words: "in (0, 1]", "> 0", "at least 1" (an integer) or ">= 0"."""
    low, high = (v.strip() for v in interval[1:-1].split(","))
    if high != "inf":
        return f"in {interval}"
    if interval[0] == "(":
        return f"> {low}"
    return f"at least {low}" if _field_type(name)[0] is int else f">= {low}"


def check_fields(cfg, names=None, fields: dict[str, dataclasses.Field] = FIELDS) -> None:
    """Every field (or those in `names`) of `cfg` against its own metadata (lib/settings.py, or an entry script's
    `shared_sections`): a finite number, one of its `choices`, inside its `range`, not empty, each item of a list
    alike; the message starts with the field's name, then the accepted values and the value given. Finiteness comes
    first: NaN passes every comparison (each is False)."""
    for name in fields if names is None else names:
        value, meta, optional = getattr(cfg, name), fields[name].metadata, _field_type(name)[1]
        why = f" ({meta['why']})" if "why" in meta else ""
        items = value if isinstance(value, list) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in items):
            raise ConfigError(f"{name}: {value} is not a finite number; give a finite value"
                              f"{' (or null for the default)' if optional else ''}")
        for value in (v for v in items if v is not None):
            if "choices" in meta and value not in meta["choices"]:
                raise ConfigError(f"{name}: {value!r} is not one of {', '.join(meta['choices'])}{why}")
            if "range" in meta and not _inside(value, meta["range"]):
                raise ConfigError(f"{name} must be {_bound_text(name, meta['range'])}{why}{' or null' * optional}, "
                                  f"got {value}")
            if "nonempty" in meta and not value.strip():
                raise ConfigError(f"{name} is empty; {meta['nonempty']}")


def validate(cfg: Config, num_processes: int | None = None, *, check_installed: bool = True) -> None:
    """Every invariant a run relies on, checked before any model is loaded. Raises ConfigError.
    The global batch is checked once the number of processes is known (the trainer passes it). check_installed
    False leaves out the packages a run would need here (bitsandbytes): for settings that are planned or printed on
    one machine and run on another (scripts/ablate.py --dry_run)."""
    move_sampling_keys(cfg)
    check_fields(cfg)
    validate_length(cfg)
    resolve_generation_batch(cfg, num_processes)
    if cfg.use_vllm is None:
        cfg.use_vllm = default_use_vllm(torch.cuda.is_available(), importlib.util.find_spec("vllm") is not None)
    if cfg.eval_strategy == "no":  # TRL's `no`: no evaluation at all, not even before and after training
        cfg.num_eval_samples, cfg.eval_steps = 0, None
    if cfg.save_strategy == "no":  # no checkpoints (a preemption signal still writes one): final/ only
        cfg.save_steps = None
    # the completions of one generation batch (TRL: per_device_train_batch_size x processes x steps_per_generation)
    global_batch = (cfg.per_device_train_batch_size * (num_processes or 1) * cfg.gradient_accumulation_steps
                    * cfg.optimizer_steps_per_generation)
    if num_processes is not None and global_batch % cfg.num_generations:
        raise ConfigError(
            f"the generation batch (per_device_train_batch_size {cfg.per_device_train_batch_size} x {num_processes} "
            f"process(es) x steps_per_generation {cfg.steps_per_generation} = {global_batch} completions) must be a "
            f"multiple of num_generations ({cfg.num_generations}); change per_device_train_batch_size, "
            f"gradient_accumulation_steps or steps_per_generation")
    if cfg.generation_kwargs and not cfg.use_vllm:
        raise ConfigError(f"generation_kwargs: {', '.join(map(repr, cfg.generation_kwargs))} cannot be applied by the "
                          f"HF sampler, which implements {', '.join(SAMPLING_KEYS)}; set use_vllm true to pass other "
                          f"keys to vLLM's SamplingParams, or remove them")
    if cfg.warmup_steps >= 1 and not float(cfg.warmup_steps).is_integer():
        raise ConfigError(f"warmup_steps must be a whole number of steps, or a share of max_steps below 1, got "
                          f"{cfg.warmup_steps}")
    if cfg.warmup_steps and cfg.warmup_ratio:
        raise ConfigError("warmup_steps and warmup_ratio both set the warm-up; give one of them")
    try:
        schedule_options(cfg.lr_scheduler_type, cfg.lr_scheduler_kwargs, cfg.learning_rate)
    except (TypeError, ValueError) as error:
        raise ConfigError(str(error)) from None
    validate_methods(cfg, global_batch if num_processes is not None else None)
    try:
        check_settings(cfg)  # what the loss type and the advantages read (lib/methods/losses.py)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if cfg.sync_ref_model and cfg.beta == 0:  # as TRL: no reference is loaded without a KL term
        raise ConfigError("sync_ref_model updates the reference of the KL term, and beta is 0 (no reference is "
                          "loaded); set beta > 0 or sync_ref_model false")
    if cfg.overlong_buffer_length is not None and cfg.overlong_buffer_length > cfg.max_completion_length:
        raise ConfigError(f"overlong_buffer_length ({cfg.overlong_buffer_length}) must not exceed "
                          f"max_completion_length ({cfg.max_completion_length})")
    per_rollout = steps_per_rollout(cfg)
    if per_rollout > 1 and cfg.save_steps and cfg.save_steps % per_rollout:
        raise ConfigError(f"save_steps ({cfg.save_steps}) must be a multiple of the optimizer steps one generation "
                          f"batch serves, num_iterations x steps_per_generation / gradient_accumulation_steps "
                          f"({cfg.num_iterations} x {cfg.optimizer_steps_per_generation} = {per_rollout}), so that a "
                          f"checkpoint never falls inside a generation batch (a resumed run could not redo it exactly)")
    if cfg.load_in_4bit and not cfg.use_peft:
        raise ConfigError("load_in_4bit trains a LoRA adapter on a 4-bit base: set use_peft true as well")
    if cfg.dtype == "float16" and not cfg.use_peft:
        # fp16 weights and AdamW states with no loss scaling: small gradients flush to zero and AdamW's epsilon
        # (1e-8) is below fp16's smallest number
        raise ConfigError("dtype: float16 would train the weights and optimizer states in fp16 without loss scaling, "
                          "which this trainer does not do. On a GPU without bf16 (T4, V100) leave dtype unset (fp32 "
                          "master weights), or train a LoRA adapter (use_peft true) on a frozen fp16 base")
    validate_backend(cfg, check_installed)
    check_asynchronous(cfg, num_processes)
    if cfg.rollout_func and (cfg.tools or cfg.environment_factory):
        raise ConfigError("rollout_func samples the completions itself, tool calls included (its env_mask marks what "
                          "the environment wrote); give it alone, without tools or environment_factory")
    num_rewards = len(cfg.reward_funcs) + bool(cfg.reward_model_name_or_path)  # the reward model counts first
    if not num_rewards and not cfg.environment_factory:  # an environment's get_reward may be the only reward (TRL)
        raise ConfigError("reward_funcs is empty: give at least one (e.g. accuracy), or an environment_factory whose "
                          "class has a get_reward method")
    if cfg.reward_weights is not None and len(cfg.reward_weights) != num_rewards:
        raise ConfigError(f"reward_weights has {len(cfg.reward_weights)} values for {num_rewards} "
                          f"reward_funcs{' and reward_model_name_or_path' * bool(cfg.reward_model_name_or_path)}; "
                          f"give one weight per function")
    if (cfg.prompt_column is None) != (cfg.answer_column is None) and cfg.dataset_name is None:
        raise ConfigError("prompt_column / answer_column apply to dataset_name, which is not set")
    for name in ("dataset_name", "eval_dataset_name"):
        value = getattr(cfg, name)
        if value and looks_local(value) and not _exists(name, value):
            raise ConfigError(f"{name}: the path {value!r} does not exist")
    if (cfg.model_name_or_path != EMBEDDED_MODEL and looks_local(cfg.model_name_or_path)
            and not _exists("model_name_or_path", cfg.model_name_or_path)):
        raise ConfigError(f"model_name_or_path: the folder {cfg.model_name_or_path!r} does not exist")
    if cfg.resume_from_checkpoint not in (None, "latest"):
        if not _exists("resume_from_checkpoint", str(Path(cfg.resume_from_checkpoint, "trainer_state.json"))):
            raise ConfigError(f"resume_from_checkpoint: {cfg.resume_from_checkpoint!r} is not a checkpoint folder "
                              f"(no trainer_state.json); pass a checkpoint-<step> folder or 'latest'")


def check_asynchronous(cfg: Config, num_processes: int | None) -> None:
    """max_staleness (docs/async.md): what the sampling thread supports, said before any model loads."""
    if cfg.vllm_inflight_updates and (cfg.max_staleness is None or not cfg.use_vllm or cfg.vllm_mode != "server"):
        raise ConfigError("vllm_inflight_updates sends weights to a generation server while it samples a batch for "
                          "the sampling thread: it needs max_staleness set and use_vllm true with "
                          "vllm_mode server; set those, or vllm_inflight_updates false")
    if cfg.vllm_inflight_updates and cfg.answer_marker:
        raise ConfigError("vllm_inflight_updates does not label the answer phase's tokens (answer_marker: a second "
                          "engine call) yet: leave answer_marker unset, or vllm_inflight_updates false")
    if cfg.sampler_device is not None:
        check_sampler_device(cfg)
    if cfg.max_staleness is None:
        return
    if cfg.weight_sync_steps > cfg.max_staleness + 1:
        raise ConfigError(f"weight_sync_steps ({cfg.weight_sync_steps}) must be at most max_staleness + 1 "
                          f"({cfg.max_staleness + 1}): a batch sampled from weights pushed that rarely could be "
                          f"older than max_staleness steps; lower weight_sync_steps or raise max_staleness")
    batches = cfg.max_staleness // steps_per_rollout(cfg) + 1  # the most batches waiting (docs/async.md 2)
    if cfg.queue_maxsize is not None and cfg.queue_maxsize < batches * cfg.local_generation_batch:
        raise ConfigError(f"queue_maxsize ({cfg.queue_maxsize}) is below the {batches * cfg.local_generation_batch} "
                          f"completions that max_staleness {cfg.max_staleness} may keep waiting ({batches} generation "
                          f"batches of {cfg.local_generation_batch}): raise queue_maxsize to "
                          f"{batches * cfg.local_generation_batch}, or lower max_staleness")
    if num_processes is not None and num_processes > 1 and (cfg.use_vllm or cfg.sampler_device is not None):
        raise ConfigError(f"max_staleness over several training processes ({num_processes} were launched) samples "
                          f"with the HF sampler's thread in each for now (use_vllm false, sampler_device unset): "
                          f"set those, launch one process (a generation server may still sample on other GPUs: "
                          f"vllm_mode server), or leave max_staleness unset")
    if cfg.use_vllm and cfg.vllm_enable_sleep_mode:
        raise ConfigError("max_staleness samples while the policy trains, and vllm_enable_sleep_mode frees the "
                          "engine's memory during training: set vllm_enable_sleep_mode false, or leave max_staleness "
                          "unset")
    if cfg.rollout_func:  # the user's function, called from the sampling thread, may read the policy as it trains
        raise ConfigError("max_staleness: rollout_func is not supported with the asynchronous sampler (the function "
                          "would run in the sampling thread while the policy trains); leave max_staleness unset")


def check_sampler_device(cfg: Config) -> None:
    """sampler_device (docs/async.md 8): the HF sampler's process, on a device this machine has."""
    if cfg.max_staleness is None or cfg.use_vllm:
        raise ConfigError("sampler_device runs the HF sampler in a process beside training: it needs max_staleness set "
                          "and use_vllm false (a vLLM engine runs in processes of its own already; vllm_mode server "
                          "puts it on GPUs of its own); set those, or leave sampler_device unset")
    try:
        device = torch.device(cfg.sampler_device)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ConfigError(f"sampler_device: {cfg.sampler_device!r} is not a device the sampler runs on; name one as "
                          f"torch does: cpu, cuda, cuda:1")
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        raise ConfigError(f"sampler_device: {cfg.sampler_device} names a GPU this machine does not have ({count} CUDA "
                          f"devices); name one of cuda:0..cuda:{count - 1}, cpu, or leave sampler_device unset"
                          if count else f"sampler_device: {cfg.sampler_device} names a GPU and this machine has "
                          f"none; use cpu, or leave sampler_device unset")


def validate_methods(cfg: Config, global_batch: int | None) -> None:
    """Each registered method's own checks, where its keys are on (lib/methods/registry.py), as ConfigError."""
    try:
        for method in METHODS.values():
            if method.uses(cfg):
                method.check(cfg, global_batch)
    except ValueError as error:
        raise ConfigError(str(error)) from None


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def move_sampling_keys(cfg: Config) -> None:
    """TRL's generation_kwargs override the sampling keys: those given there move into their own keys (and are
    checked as given there); any other generation_kwargs key needs vLLM (lib/sampling/vllm_rollout.py checks it there)."""
    extra = dict(cfg.generation_kwargs or {})
    given = [key for key in SAMPLING_KEYS if key in extra]
    if not given:
        return
    try:
        for key in given:
            setattr(cfg, key, _coerce(key, extra.pop(key)))
        check_fields(cfg, given)
    except ConfigError as error:
        raise ConfigError(f"generation_kwargs ({', '.join(given)}): {error}") from None
    cfg.generation_kwargs = extra or None


def _exists(name: str, path: str) -> bool:
    """Whether a path exists; ConfigError for a name the OS refuses (a NUL byte, too long) instead of its raw error."""
    try:
        return Path(os.path.expanduser(path)).exists()
    except (OSError, ValueError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise ConfigError(f"{name}: {path!r:.80} is not a usable path ({reason}); give an existing path") from None


def validate_backend(cfg: Config, check_installed: bool = True) -> None:
    """The optimizer and the memory budget: what each needs installed (where `check_installed`; a memory estimate runs
    nothing, so it needs neither), and what each needs besides. use_vllm's keys are lib/sampling/vllm_rollout.py's
    (`check_settings`, which train_agrpo.main calls right after parsing)."""
    check_installed = check_installed and not cfg.estimate_memory_only
    if (check_installed and cfg.optim.startswith(("adamw_8bit", "paged"))
            and importlib.util.find_spec("bitsandbytes") is None):
        raise ConfigError(f"optim: {cfg.optim!r} needs bitsandbytes: pip install bitsandbytes (or --optim adamw_torch)")
    if cfg.estimate_processes > 1 and cfg.use_peft and cfg.estimate_sharding != "ddp":
        raise ConfigError("estimate_processes: FSDP2 and DeepSpeed shard full fine-tuning; LoRA / QLoRA train data "
                          "parallel (their estimate is per GPU as it is): --estimate_sharding ddp, or drop use_peft")


def default_use_vllm(cuda: bool, vllm_installed: bool) -> bool:
    """use_vllm's default: the engine on a CUDA GPU where vLLM is installed, our HF loop elsewhere (why:
    docs/performance.md 4)."""
    return cuda and vllm_installed


def validate_length(cfg: Config) -> None:
    """max_steps, or -1 with num_train_epochs (TRL's convention), and the strategies that count in epochs."""
    if cfg.max_steps == -1:
        if cfg.num_train_epochs is None:
            raise ConfigError("max_steps -1 trains for num_train_epochs, which is not set; give max_steps or "
                              "num_train_epochs")
    elif cfg.max_steps < 1:
        raise ConfigError(f"max_steps must be at least 1 (or -1 with num_train_epochs), got {cfg.max_steps}")


def resolve_generation_batch(cfg: Config, num_processes: int | None) -> None:
    """steps_per_generation in TRL's meaning (micro-batches per generation batch, default gradient_accumulation_steps),
    from generation_batch_size once the number of processes is known. It must be a whole number of optimizer steps:
    TRL lets a generation batch end inside an accumulation, this trainer does not."""
    per_micro = cfg.per_device_train_batch_size * (num_processes or 1)
    if cfg.generation_batch_size is not None:
        if cfg.steps_per_generation is not None:
            raise ConfigError("generation_batch_size and steps_per_generation both set the generation batch; give "
                              "one of them")
        if num_processes is None:
            return  # resolved when the trainer knows the processes
        if cfg.generation_batch_size % per_micro:
            raise ConfigError(f"generation_batch_size ({cfg.generation_batch_size}) must be a multiple of "
                              f"per_device_train_batch_size x processes ({per_micro})")
        cfg.steps_per_generation, cfg.generation_batch_size = cfg.generation_batch_size // per_micro, None
    if cfg.steps_per_generation is None:
        if num_processes is not None:
            cfg.steps_per_generation = cfg.gradient_accumulation_steps
        return
    if cfg.steps_per_generation < 1 or cfg.steps_per_generation % cfg.gradient_accumulation_steps:
        raise ConfigError(f"steps_per_generation ({cfg.steps_per_generation}) counts micro-batches (TRL's meaning) and "
                          f"must be a positive multiple of gradient_accumulation_steps "
                          f"({cfg.gradient_accumulation_steps}): each optimizer step takes whole micro-batches of "
                          f"one generation batch")


def to_dict(cfg: Config) -> dict:
    """The configuration as plain values, for config.yaml, checkpoints and trackers: secrets (hub_token) are null
    here, so that no file or tracker holds them (docs/hub.md)."""
    return {**dataclasses.asdict(cfg), **dict.fromkeys(SECRET_KEYS, None)}


def save_yaml(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
