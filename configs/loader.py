"""Load a run config from YAML (or JSON) plus dotted command-line overrides.

    cfg = load_config("configs/quickstart.yaml", ["learner.loss.epsilon_high=2.0"])

Override values are parsed as YAML scalars, so `2.0`, `true`, `null` and `[a, b]` get their
natural types. Errors are collected into one `ConfigError` whose lines name the file and line
(or the override) each bad key or value came from, and list the valid keys or choices; a
section's own check names the section's line and the overrides of keys inside it.
"""

from __future__ import annotations

import datetime
import io
import json
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from staleflow.configs.schema import RunConfig

__all__ = [
    "ConfigError",
    "apply_overrides",
    "check_distinct_overrides",
    "dump_config",
    "dump_redacted",
    "load_config",
    "parse_config",
    "password_masked",
    "read_yaml",
    "redact",
    "redact_override",
    "redacted_dict",
]

Loc = tuple[str, ...]
# The password of scheme://user:password@host: masked up to the last '@' before the next
# whitespace, so a password holding '@', '/', '#', '?' or quotes (unencoded) is masked whole
# (redis-py ends it at the netloc's last '@'). And a password given as a query option.
_URL_PASSWORD = re.compile(r"(\w+://[^\s:/@]*:)\S*@")
# (up to a quote too: in JSON text the value must not swallow the string's closing quote)
_QUERY_PASSWORD = re.compile(r"([?&][^=&#\s\"']*password=)[^&#\s\"']*", re.I)  # ssl_password too
# A URL-valued key inside a mapping given on the command line (buffer={redis_url: ...}): its
# value may carry a password without a scheme, which `redact` would not recognise.
_URL_IN_MAPPING = re.compile(r"""(\w*url\s*[:=]\s*)(["']?)([^"',}\s]+)""", re.I)


class ConfigError(ValueError):
    """A config that cannot be loaded; the message says where and what to change."""


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Read `path`, apply `overrides` ("a.b.c=value"), validate, and return the frozen config."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}; save it as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    return parse_config(text, overrides, source=str(path))


def parse_config(text: str, overrides: Sequence[str] = (), source: str = "<string>") -> RunConfig:
    """Like `load_config`, from the text of a YAML or JSON document."""
    data, lines = _parse_yaml(text, source)
    origins: dict[Loc, str] = {loc: f"{source}:{line}" for loc, line in lines.items()}
    data = apply_overrides(data, overrides, origins)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, data, origins, source)) from None


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as JSON; `parse_config` of it gives back an equal config."""
    return cfg.model_dump_json(indent=2)


def dump_redacted(cfg: RunConfig) -> str:
    """The resolved config as JSON with every password masked (what a run's config.json
    and `staleflow config` show): masked string by string, so the text stays valid JSON."""
    return json.dumps(redacted_dict(cfg), indent=2)


def apply_overrides(
    data: dict[str, Any], overrides: Iterable[str], origins: dict[Loc, str] | None = None
) -> dict[str, Any]:
    """Return a copy of `data` with each "dotted.key=value" applied (value parsed as YAML)."""
    data = _deep_copy(data)
    for given in overrides:
        key, sep, raw = given.partition("=")
        loc = tuple(key.strip().split("."))
        # as errors show it: a URL's password masked even without its scheme
        item = redact_override(given)
        if not sep or not all(loc):
            raise ConfigError(
                f"override {item!r} is not of the form section.key=value "
                "(e.g. learner.loss.epsilon_high=2.0)"
            )
        try:
            value = yaml.load(raw, Loader=YamlLoader) if raw.strip() else ""
        except ValueError as exc:  # an integer past Python's 4300 digits
            raise ConfigError(f"override {item!r}: value cannot be read: {exc}") from None
        except yaml.YAMLError as exc:
            detail = str(exc)
            if item != given:  # a password was masked: not the parser's quote of the raw text
                parts = (getattr(exc, "context", None), getattr(exc, "problem", None))
                detail = "; ".join(p for p in parts if p) or type(exc).__name__
            message = f"override {item!r}: value is not valid YAML: {detail}"
            if "alias" in str(exc):  # task.operations=[*]: YAML's alias mark
                message += "\n(quote a value that starts with * or &, e.g. \"['*']\")"
            raise ConfigError(_mask_urls_in_mappings(redact(message))) from None
        node = data
        for depth, part in enumerate(loc[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    f"override {item!r}: {'.'.join(loc[: depth + 1])} is a value "
                    f"({child!r}), not a section"
                )
            node = child
        node[loc[-1]] = value
        if origins is not None:  # a section set whole: errors inside it name the override
            for inside in [o for o in origins if o[: len(loc)] == loc]:
                del origins[inside]
            origins[loc] = f"override {item!r}"
    return data


def key_dropped_by_section(overrides: Sequence[str]) -> tuple[str, str] | None:
    """(key, section) for the first override key that a later override replaces with its
    whole section (a mapping value drops what was set inside it), or None. Overrides apply in
    order: a key set after its section applies on top of it, and is fine."""
    keys = [o.partition("=")[0].strip() for o in overrides]
    for i, key in enumerate(keys):
        for later in keys[i + 1 :]:
            if key.startswith(f"{later}."):
                return key, later
    return None


def check_distinct_overrides(
    overrides: Sequence[str], flags: Mapping[str, str] | None = None
) -> None:
    """Refuse a key the command line sets twice, where the last would win without a word: by
    two overrides, or by an override and the flag for the same key (`flags` maps a key to
    the flag given for it, e.g. {"rollout.num_workers": "--workers 3"})."""
    seen: dict[str, str] = {}
    for given in overrides:
        key = given.partition("=")[0].strip()
        if key in seen:
            raise ConfigError(
                f"{key} is set twice on the command line ({redact_override(seen[key])!r} and "
                f"{redact_override(given)!r}); keep one"
            )
        seen[key] = given
    dropped = key_dropped_by_section(overrides)
    if dropped is not None:  # run.steps=50 run={eval_every: 5}: run.steps was dropped
        lost, key = dropped
        earlier, given = redact_override(seen[lost]), redact_override(seen[key])
        raise ConfigError(
            f"{given!r} sets {key} whole, after {earlier!r} set {lost} inside it, which it "
            f"would drop; put {lost} inside that value, or set {key} key by key"
        )
    for key, flag in (flags or {}).items():
        # (an override of a section holding the key, 'rollout={num_workers: 2}', sets it too)
        holder = next((k for k in seen if k == key or key.startswith(f"{k}.")), None)
        if holder is not None:
            raise ConfigError(
                f"{flag} and the override {redact_override(seen[holder])!r} both set {key}; "
                "keep one"
            )


def redact_override(override: str) -> str:
    """A "dotted.key=value" override with the password of any URL it sets masked."""
    key, sep, raw = override.partition("=")
    return _masked_override(key, raw) if sep else redact(override)


def _masked_override(key: str, raw: str) -> str:
    """An override as errors show it: the password of a URL it sets masked, whether the URL
    is its value (buffer.redis_url=...) or inside a mapping (buffer={redis_url: ...})."""
    if key.strip().endswith("url"):
        return f"{key}={redact_url(raw)}"
    return f"{key}={_mask_urls_in_mappings(redact(raw))}"


def _mask_urls_in_mappings(text: str) -> str:
    return _URL_IN_MAPPING.sub(lambda m: m[1] + m[2] + redact_url(m[3]), text)


def redact(text: str) -> str:
    """Mask the password of every URL in `text` (scheme://user:password@host -> user:***@,
    ?password=... -> ?password=***). Only URLs with a scheme: in free text `a:b@c` is not
    always a credential (a path may hold one); see `redact_url` for a value known to be a URL."""
    return _QUERY_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", text))


def password_masked(url: str) -> bool:
    """True if `url` carries a password that `redact` masked (in its user part or as a
    ?password= option): the real one is not stored, and connecting with '***' would fail."""
    return any(m.group(0).endswith("***@") for m in _URL_PASSWORD.finditer(url)) or any(
        m.group(0).endswith("=***") for m in _QUERY_PASSWORD.finditer(url)
    )


def redacted_dict(cfg: RunConfig) -> dict[str, Any]:
    """`cfg` as plain JSON data with every string's passwords masked, each string on its
    own: `redact` on a whole compact JSON text would mask from one URL's `host:` to an '@'
    in any later value (an output_dir such as /data/exp@v2), dropping the keys between."""

    def mask(value: Any) -> Any:
        if isinstance(value, str):
            return redact(value)
        if isinstance(value, dict):
            return {key: mask(v) for key, v in value.items()}
        if isinstance(value, list):
            return [mask(v) for v in value]
        return value

    return dict(mask(json.loads(cfg.model_dump_json())))


def redact_url(url: str) -> str:
    """`url`, a value given as a URL (possibly without its scheme, or malformed), with any
    password masked: everything between the user name and the last '@'."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    userinfo, at, host = rest.rpartition("@")
    if at and ":" in userinfo:
        rest = f"{userinfo.split(':', 1)[0]}:***@{host}"
    return redact(f"{scheme}{sep}{rest}")


def named_text(text: str, name: str) -> io.StringIO:
    """`text` as a stream named `name`, so that PyYAML's errors say `in "run.yaml", line 4`
    rather than `in "<unicode string>"`."""
    stream = io.StringIO(text)
    stream.name = name  # PyYAML reads a file-like stream's name
    return stream


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader less two YAML 1.1 readings no one writing a config means: 1:30 as
    90 (base 60) and 010 as 8 (octal). Both stay text, as YAML 1.2 and JSON have it: a number
    field then takes "010" as 10, and refuses "1:30" by name instead of running with 90."""

    def resolve(self, kind: type[yaml.Node], value: Any, implicit: tuple[bool, bool]) -> str:
        if kind is yaml.ScalarNode and implicit[0] and _BASE60_OR_OCTAL.fullmatch(value):
            return "tag:yaml.org,2002:str"
        tag: str = super().resolve(kind, value, implicit)  # type: ignore[no-untyped-call]
        return tag


_BASE60_OR_OCTAL = re.compile(r"[-+]?(?:[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?|0[0-7_]+)")


def read_yaml(text: str, source: str) -> Any:
    """The data of a YAML (or JSON) document as configs and sweep files read it (YamlLoader;
    a JSON document's tabs as spaces). Raises yaml.YAMLError, naming `source`, and
    ConfigError for a key given twice in one mapping (YAML would keep the last silently) or
    a mapping that holds itself through an alias."""
    return _read(_untabbed(text), source)[0]


def _read(text: str, source: str) -> tuple[Any, dict[Loc, int]]:
    """The document's data, and the 1-based line of every key (checked as `read_yaml` says)."""
    root = yaml.compose(named_text(text, source), Loader=YamlLoader)
    lines = _key_lines(root, source)
    return yaml.load(named_text(text, source), Loader=YamlLoader), lines


_MAX_KEYS = 100_000  # a config has a few hundred keys; aliases can multiply them without end


def _key_lines(root: yaml.Node | None, source: str) -> dict[Loc, int]:
    lines: dict[Loc, int] = {}

    def walk(node: yaml.Node | None, loc: Loc, inside: frozenset[int]) -> None:
        if isinstance(node, yaml.MappingNode):
            inside |= {id(node)}
            if len(lines) + len(node.value) > _MAX_KEYS:  # 8 aliases a level, 8 levels: 8**8
                raise ConfigError(
                    f"{source}: holds more than {_MAX_KEYS} keys once its YAML aliases (*name) "
                    "are expanded; a config has a few hundred: write the values out"
                )
            for key_node, value_node in node.value:
                sub = (*loc, str(key_node.value))
                line = key_node.start_mark.line + 1
                if sub in lines:  # YAML keeps the last silently, dropping the first's keys
                    raise ConfigError(
                        f"{source}:{line}: {'.'.join(sub)} is given twice (also line "
                        f"{lines[sub]}); merge the two into one"
                    )
                if id(value_node) in inside:  # x: &a {b: *a} never ends
                    raise ConfigError(
                        f"{source}:{line}: {'.'.join(sub)} holds the mapping it is in, through "
                        "a YAML alias (*name of an &name above it); write the value out"
                    )
                lines[sub] = line
                walk(value_node, sub, inside)

    walk(root, (), frozenset())
    return lines


def _untabbed(text: str) -> str:
    if "\t" in text and _is_json(text):
        # YAML refuses a tab where JSON allows it (indentation); in valid JSON a tab can only
        # be whitespace (a string holds it escaped), so spaces read the same, line for line
        return text.replace("\t", " ")
    return text


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _parse_yaml(text: str, source: str) -> tuple[dict[str, Any], dict[Loc, int]]:
    """Parse the document and record the 1-based line of every key."""
    try:
        data, lines = _read(_untabbed(text), source)
    except ConfigError:
        raise
    except ValueError as exc:  # an integer past Python's 4300 digits (not a YAMLError)
        raise ConfigError(f"{source}: a value cannot be read: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        raise ConfigError(redact(f"{where}: not valid YAML: {exc}")) from None  # quotes the line
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: a config must be a mapping of sections (model, task, rollout, ...), "
            f"got {type(data).__name__}"
        )
    return data, lines


def _describe(
    exc: ValidationError, data: dict[str, Any], origins: dict[Loc, str], source: str
) -> str:
    out = [f"invalid config ({source}):"]
    for err in exc.errors():
        loc = _data_loc(err["loc"], data)
        msg, show_input = err["msg"], not isinstance(err.get("input"), dict | list)
        if err["type"] == "extra_forbidden":
            valid = _valid_keys(err["loc"][:-1])
            msg = "unknown key" + (f"; valid keys here: {', '.join(valid)}" if valid else "")
            show_input = False
            key = str(loc[-1]) if loc else ""
            first, _, rest = key.partition(".")  # `run.steps: 5` in a file
            if "." in key and first in valid:
                given = (_origin(loc, origins) or "").startswith("override ")
                msg = (
                    "unknown key: inside a mapping value a key is not dotted: nest it"
                    if given
                    else "unknown key: a dotted key is for the command line and sweep files; "
                    "in a config file, nest it"
                ) + f": {first}: {{{rest}: ...}}"
            name_origin = origins.get((*loc[:-1], "name"), "")
            key_origin = origins.get(loc, "")
            if name_origin.startswith("override ") and not key_origin.startswith("override "):
                # a preset switched by override keeps the file's keys of the old one
                name = (_node_at(data, loc[:-1]) or {}).get("name")
                section = ".".join(loc[:-1])
                msg += (
                    f" (the override of {section}.name keeps the file's other {section} keys, "
                    f"which {name} does not take: replace the section instead, "
                    f"'{section}={{name: {name}}}')"
                )
        elif err["type"] in ("model_attributes_type", "model_type", "dict_type") and loc:
            section = ".".join(loc)
            example = f" (e.g. {section}.name=grpo)" if section == "learner.loss" else ""
            if err.get("input") is None and not origins.get(loc, "").startswith("override "):
                # `run:` with nothing below it, in a file: YAML reads it as null
                msg = (
                    f"{section} is empty (YAML reads a key with nothing after it as null): "
                    f"indent its keys below it, or remove the line"
                )
            else:
                msg = (
                    f"{section} is a section, not a value: set its keys one by one, "
                    f"{section}.KEY=VALUE{example}, or give a mapping, "
                    f"'{section}={{KEY: VALUE}}'"
                )
        elif err["type"] == "missing":
            msg, show_input = "required key is missing", False
        elif err["type"] == "union_tag_not_found":
            ctx = err.get("ctx", {})
            loc = (*loc, str(ctx.get("discriminator", "name")).strip("'"))
            msg = f"required key is missing; valid: {', '.join(_tags(err['loc']))}"
            default = _default_tag(err["loc"])
            if default:  # learner.loss.entropy_coef=0.01 alone: the default looked implied
                msg += (
                    f" (the default, {default}, applies only where {'.'.join(loc[:-1])} is not "
                    f"given at all: with any of its keys, give {loc[-1]} too)"
                )
            show_input = False
        elif err["type"] == "union_tag_invalid":
            ctx = err.get("ctx", {})
            loc = (*loc, str(ctx.get("discriminator", "name")).strip("'"))
            msg = f"unknown choice {ctx.get('tag')!r}; valid: {ctx.get('expected_tags')}"
            show_input = False
        elif err["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
            key, sep, rest = msg.partition(": ")  # a section's check naming one of its keys
            parent = _node_at(data, loc[:-1]) if loc else None
            if parent is not None and loc[-1] not in parent:  # a union tag (loss.<grpo>)
                loc = loc[:-1]
            if sep and key in (_node_at(data, loc) or {}):
                loc, msg = (*loc, key), rest
        if show_input and err.get("input") is not None:
            value = err["input"]
            if isinstance(value, str) and loc and loc[-1].endswith("url"):
                value = redact_url(value)  # a URL, maybe without its scheme: mask it as one
            msg += f" (got {value!r})"
            if (
                err["type"] in ("int_parsing", "float_parsing", "int_type", "float_type")
                and isinstance(value, str)
                and ":" in value
                and _BASE60_OR_OCTAL.fullmatch(value)
            ):  # a number field given minutes:seconds
                msg += "; write one plain number: 1:30 is not read as 90 (base 60)"
        if err["type"] == "string_type" and "input" in err and err["input"] is None:
            msg += " (YAML reads ~, null and an empty value as null: quote text, e.g. '~/runs')"
        if err["type"] == "string_type" and isinstance(
            err.get("input"), bool | int | float | datetime.date
        ):  # YAML read the text as a number, a date or (yes/no/on/off) a boolean
            key, origin = ".".join(loc), origins.get(loc, "")
            if len(loc) > 1 and loc[-1].isdigit():  # an item of a list: its list's key
                msg += f"; quote the item to keep it text: {loc[-2]}: ['...']"
            elif origin.startswith("override '"):
                raw = origin.removeprefix("override '")[:-1].partition("=")[2]
                msg += f"; quote it to keep it text: \"{key}='{raw}'\""
            else:
                msg += f"; quote it to keep it text: {loc[-1]}: '...'"
        where = _where(loc, data, origins) or source
        out.append(redact(f"  {where}: {'.'.join(loc) or '<top level>'}: {msg}"))
    return "\n".join(out)


def _data_loc(loc: Sequence[int | str], data: Any) -> Loc:
    """Drop the union-tag parts pydantic inserts (e.g. learner.loss.<grpo>.epsilon_low)."""
    kept: list[str] = []
    node: Any = data
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif isinstance(node, dict) and i < len(loc) - 1:
            continue  # a union tag: present in pydantic's loc, absent from the data
        else:
            node = None
        kept.append(str(part))
    return tuple(kept)


def _node_at(data: Any, loc: Loc) -> Any:
    for part in loc:
        data = data.get(part) if isinstance(data, dict) else None
    return data if isinstance(data, dict) else None


def _where(loc: Loc, data: dict[str, Any], origins: dict[Loc, str]) -> str | None:
    """Where the value at `loc` came from. A section's own check (the error is at a
    section, not a key) may fail because of any key in it: the overrides that set one are
    named too, since the file's line for the section is then not the whole story."""
    where = _origin(loc, origins)
    section = loc
    if loc and _node_at(data, loc) is None:  # a key: its own line or override, or if it
        parent = _node_at(data, loc[:-1]) if len(loc) > 1 else data  # is missing, the
        if loc in origins or (isinstance(parent, dict) and loc[-1] in parent):  # overrides
            return where  # that made its section
        section = loc[:-1]
    inside = [
        origin
        for key, origin in origins.items()
        if len(key) > len(section)
        and key[: len(section)] == section
        and origin.startswith("override ")
    ]
    return ", ".join(dict.fromkeys([where, *inside] if where else inside)) or None


def _origin(loc: Loc, origins: dict[Loc, str]) -> str | None:
    for n in range(len(loc), 0, -1):
        if loc[:n] in origins:
            return origins[loc[:n]]
    return None


def _valid_keys(loc: Sequence[int | str]) -> list[str]:
    """Field names of the model at `loc`; [] if it cannot be found."""
    model = _model_at(loc)
    return sorted(model.model_fields) if model is not None else []


def _model_at(loc: Sequence[int | str]) -> type[BaseModel] | None:
    """The config model at pydantic's `loc`, following union tags (e.g. loss.<grpo>)."""
    model: type[BaseModel] | None = RunConfig
    parts = list(loc)
    while parts and model is not None:
        field = model.model_fields.get(str(parts.pop(0)))
        candidates = _models_in(field.annotation) if field is not None else []
        if len(candidates) == 1:
            model = candidates[0]
        elif candidates and parts:
            tag = parts.pop(0)
            model = next((c for c in candidates if c.model_fields["name"].default == tag), None)
        else:
            model = None
    return model


def _tags(loc: Sequence[int | str]) -> list[str]:
    """The `name` choices of the discriminated union at `loc`."""
    parent = _model_at(loc[:-1])
    field = parent.model_fields.get(str(loc[-1])) if parent is not None else None
    models = _models_in(field.annotation) if field is not None else []
    return [str(m.model_fields["name"].default) for m in models if "name" in m.model_fields]


def _default_tag(loc: Sequence[int | str]) -> str | None:
    """The `name` of the default value of the discriminated union at `loc`, if it has one."""
    parent = _model_at(loc[:-1])
    field = parent.model_fields.get(str(loc[-1])) if parent is not None else None
    if field is None:
        return None
    default = field.default_factory() if field.default_factory else field.default  # type: ignore[call-arg]
    name = getattr(default, "name", None)
    return name if isinstance(name, str) else None


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    return []
