"""Reading config files and reporting their problems, one line each, for :mod:`tierd.config`.

Every problem names its YAML path (``tiers.1.policy``), the bad value and what is allowed;
a key that is not a setting also suggests the setting it may be a misspelling of
(``socket.pth: not a setting; did you mean socket.path?``). Directory values expand ``~``
and ``$VAR`` / ``${VAR}`` / ``${VAR:-default}``.

A config file is read only when it is a regular file (a FIFO would block its reader
until someone writes to it; a device may never end) of at most :data:`MAX_CONFIG_BYTES`,
and its YAML may expand to at most :data:`MAX_CONFIG_VALUES` values (aliases can make a
small file stand for an enormous tree). The checks are made on the opened descriptor
(opened non-blocking), so what is checked is what is read.
"""

from __future__ import annotations

import difflib
import os
import re
import stat
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tierd.errors import ConfigError
from tierd.units import format_bytes

__all__ = [
    "AT_PATH",
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_VALUES",
    "close_matches",
    "expand_path",
    "format_validation_error",
    "problem_line",
    "read_config_file",
]

AT_PATH = "config_path"  # the error type whose ``ctx.path`` extends its location
MAX_CONFIG_BYTES = 1 << 20  # a config file past this is refused, unread
# Values (mappings, lists, scalars) the parsed YAML may hold: a file without aliases
# cannot reach it (every value takes at least a byte), so only an alias bomb does.
MAX_CONFIG_VALUES = MAX_CONFIG_BYTES
_VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")


def expand_path(value: str | Path, environ: Mapping[str, str] | None = None) -> Path:
    """``value`` with ``$VAR``, ``${VAR}`` and ``${VAR:-default}`` replaced (the default
    when the variable is unset or empty), then a leading ``~`` expanded. ``ValueError``
    names a variable that is unset and has no default."""
    env = os.environ if environ is None else environ

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(3)
        value = env.get(name, "")
        if value:
            return value
        if match.group(2) is not None:
            return match.group(2)
        raise ValueError(f"${name} is not set (write ${{{name}:-DEFAULT}} to give a default)")

    return Path(os.path.expanduser(_VARIABLE.sub(replace, str(value))))


def close_matches(word: str, choices: Iterable[str], prefix: str = "") -> str:
    """``"; did you mean PREFIX+X?"`` for the closest X of ``choices``, else ``""``."""
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {prefix}{found[0]}?" if found else ""


def format_validation_error(
    error: ValidationError,
    prefix: str = "",
    *,
    sources: Mapping[str, str] | None = None,
    model: type[BaseModel] | None = None,
) -> str:
    """One line per problem: ``path: message (got value)``. ``sources`` maps a dotted path
    to where its value came from (``"--set"``); a problem at or below it says so:
    ``socket.mode (from --set): ...``. With ``model`` (the validated model), an unknown
    key suggests the closest known one. Messages are the config's own words, never
    pydantic's (``must be at least 1``, not ``Input should be greater than or equal``)."""
    lines = []
    for problem in error.errors():
        loc = ([prefix] if prefix else []) + _file_path(model, problem["loc"])[0]
        if problem["type"] == AT_PATH:  # a model validator's problems, one line each
            for at, message in problem.get("ctx", {})["problems"]:
                lines.append(problem_line(".".join(loc + str(at).split(".")), message, sources))
            continue
        got = problem.get("input")
        quiet = isinstance(got, dict | list | BaseModel) or problem["type"] == "missing"
        message = _plain_message(problem)
        if problem["type"] == "extra_forbidden" and model is not None:
            found = _file_path(model, problem["loc"][:-1])[1]
            known = list(found.model_fields) if found is not None else []
            parent = "".join(f"{part}." for part in loc[:-1])
            message, quiet = f"not a setting{close_matches(loc[-1], known, parent)}", True
        shown = "" if quiet else _shown(got)
        said = quiet or shown in message  # the message names the value already
        lines.append(
            problem_line(".".join(loc), message + ("" if said else f" (got {shown})"), sources)
        )
    return "\n".join(lines)


def problem_line(path: str, message: str, sources: Mapping[str, str] | None = None) -> str:
    """``path (from SOURCE): message``, the source named when ``sources`` has one for it."""
    origin = _origin(path, sources or {})
    return f"{path or '<root>'}{f' (from {origin})' if origin else ''}: {message}"


_PLAIN = {
    "greater_than_equal": "must be at least {ge}",
    "greater_than": "must be more than {gt}",
    "less_than_equal": "must be at most {le}",
    "less_than": "must be less than {lt}",
    "string_too_short": "needs at least {min_length} character(s)",
    "string_too_long": "takes at most {max_length} characters",
    "string_pattern_mismatch": "must match the pattern {pattern}",
    "missing": "is required",
    "int_parsing": "must be a whole number",
    "int_type": "must be a whole number",
    "int_from_float": "must be a whole number",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "bool_parsing": "must be true or false",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a mapping (key: value)",
    "model_type": "must be a mapping (key: value)",
    "model_attributes_type": "must be a mapping (key: value)",
    "enum": "must be one of {expected}",
    "literal_error": "must be {expected}",
    "extra_forbidden": "not a setting",
}


def _plain_message(problem: Mapping[str, Any]) -> str:
    """A pydantic problem in the config's own words."""
    kind, context = problem["type"], problem.get("ctx") or {}
    if kind in ("too_short", "too_long"):
        count = context.get("min_length" if kind == "too_short" else "max_length", 0)
        noun = "item" if count == 1 else "items"
        return (
            f"needs at least {count} {noun}"
            if kind == "too_short"
            else f"takes at most {count} {noun}"
        )
    template = _PLAIN.get(kind)
    raw = str(problem["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if template is None:
        return raw  # our own validators' messages, already in the config's words
    try:
        return template.format(**context)
    except KeyError:  # a context without the value the phrase names
        return raw


def _shown(value: object, limit: int = 80) -> str:
    """``repr(value)``, shortened: a config value can be a 400-digit number."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        return (
            f"an integer of about {int.bit_length(value) * 3 // 10} digits"
            if isinstance(value, int)
            else "?"
        )
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _file_path(
    model: type[BaseModel] | None, loc: Iterable[int | str]
) -> tuple[list[str], type[BaseModel] | None]:
    """``loc`` as the file spells it, and the model it leads to (None: no one model).
    pydantic puts a tagged union's tag after its field (``remote.s3.bucket``) where the
    file has no such key (``remote: {kind: s3, bucket: ...}``): the tag picks the model
    and is left out of the path. List indexes stay in the path and keep the model."""
    path: list[str] = []
    here: Any = model
    for part in loc:
        text = str(part)
        models = _models_in(here)
        tags = {_tag(m): m for m in models} if len(models) > 1 else {}
        if text in tags:
            here = tags[text]
            continue
        path.append(text or "''")
        if isinstance(part, int):
            continue
        field = models[0].model_fields.get(text) if len(models) == 1 else None
        here = None if field is None else field.annotation
    found = _models_in(here)
    return path, found[0] if len(found) == 1 else None


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The model classes inside ``annotation`` (``X``, ``list[X]``, ``X | Y | None``,
    ``Annotated[X | Y, ...]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if origin in (list, typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    return []


def _tag(model: type[BaseModel]) -> str | None:
    """The value of a model's ``kind: Literal[...]`` field: its tag in a tagged union."""
    field = model.model_fields.get("kind")
    values = typing.get_args(field.annotation) if field is not None else ()
    return str(values[0]) if len(values) == 1 else None


def _origin(path: str, sources: Mapping[str, str]) -> str | None:
    """The source of the longest path in ``sources`` that is ``path`` or contains it."""
    for known in sorted(sources, key=len, reverse=True):
        if path == known or path.startswith(f"{known}."):
            return sources[known]
    return None


def read_config_file(path: Path | str) -> dict[str, Any]:
    """The top-level mapping of a YAML file (an empty file is an empty mapping);
    :class:`ConfigError` naming the file when it cannot be read, is not a regular file,
    is over :data:`MAX_CONFIG_BYTES`, or is not a mapping. Blocks only on the file's own
    reads, never on a writer: call it off the event loop."""
    path = Path(path)
    raw = _read_bounded(path)
    try:
        data = yaml.load(raw.decode("utf-8"), Loader=_UniqueKeys)  # a SafeLoader
    except UnicodeDecodeError as exc:
        message = f"not a text file: byte {exc.start} is not UTF-8 (is this the right file?)"
        raise ConfigError(message, path=str(path)) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", path=str(path)) from exc
    except (ValueError, RecursionError) as exc:  # e.g. an integer of 5,000 digits
        raise ConfigError(f"cannot read the YAML: {exc}", path=str(path)) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("the config must be a mapping at the top level", path=str(path))
    _check_expansion(data, path)
    return data


class _UniqueKeys(yaml.SafeLoader):
    """The safe loader, refusing a key given twice in one mapping. YAML wants keys
    unique, but PyYAML keeps the last one silently: a key repeated further down a long
    file undid the first without a word."""


def _unique_mapping(loader: _UniqueKeys, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        line = key_node.start_mark.line + 1
        try:
            first = seen.get(key)
        except TypeError:  # not hashable: the loader's own error says so below
            continue
        seen.setdefault(key, line)
        if first is not None:  # on another line, or on the same one ({a: 1, a: 2})
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"key {key!r} is given twice (lines {first} and {line})",
                key_node.start_mark,
            )
    return loader.construct_mapping(node)


_UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _read_bounded(path: Path) -> bytes:
    """The bytes of the regular file at ``path``, at most :data:`MAX_CONFIG_BYTES`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"cannot read config file: {exc.strerror}", path=str(path)) from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ConfigError(
                f"not a regular file ({_kind(mode)}): a config must be a plain file",
                path=str(path),
            )
        chunks, size = [], 0
        while size <= MAX_CONFIG_BYTES and (chunk := os.read(fd, 1 << 16)):
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ConfigError(f"cannot read config file: {exc.strerror}", path=str(path)) from exc
    finally:
        os.close(fd)
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"the file is over {format_bytes(MAX_CONFIG_BYTES)}, the most a config may"
            " take (is this the right file?)",
            path=str(path),
        )
    return b"".join(chunks)


def _kind(mode: int) -> str:
    kinds = {
        stat.S_IFIFO: "a FIFO",
        stat.S_IFDIR: "a directory",
        stat.S_IFCHR: "a character device",
        stat.S_IFBLK: "a block device",
        stat.S_IFSOCK: "a socket",
    }
    return kinds.get(stat.S_IFMT(mode), "not a file")


def _check_expansion(data: dict[str, Any], path: Path) -> None:
    """:class:`ConfigError` when ``data`` holds more than :data:`MAX_CONFIG_VALUES`
    values, counting a value reached through several aliases each time (as the checks
    that follow walk it). Stops counting at the bound."""
    count, stack = 0, [data]
    while stack:
        node = stack.pop()
        count += 1
        if count > MAX_CONFIG_VALUES:
            raise ConfigError(
                f"the YAML expands to more than {MAX_CONFIG_VALUES:,} values (aliases"
                " repeating aliases?)",
                path=str(path),
            )
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
