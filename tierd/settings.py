"""Where the daemon's settings come from, and which source wins.

Layers, lowest first: the model defaults < the YAML file < ``TIERD_*`` environment
variables < ``--set PATH=VALUE`` on the command line. The layers are merged into one
mapping (mappings merge key by key; a list or a plain value replaces what was there) that
is validated once as a :class:`~tierd.config.DaemonConfig`, so every problem names the path
of the bad value whichever layer brought it, and says so when it came from the environment
or the command line: ``socket.mode (from --set): ...``.

Paths are dotted (``socket.mode``, ``tiers.0.capacity``); a list item is addressed by its
index, or by its ``name`` (``tiers.disk.capacity``). Values are read as YAML (``true``,
``10``, ``[a, b]``, ``0o600``); text that is not valid YAML is taken as a plain string.

Environment variables are ``TIERD_<PATH>`` with ``__`` between segments, in any case:
``TIERD_SOCKET__PATH=/run/tierd/tierd.sock``, ``TIERD_TIERS__0__CAPACITY=2GiB``. Every
other ``TIERD_*`` variable must be one of :data:`NON_SETTING_ENV` (``TIERD_CONFIG`` names
the file when none is given, ``TIERD_SOCKET`` is the client commands' override of the
socket path; the rest belong to the scripts and the tests): a misspelt one
(``TIERD_BLOK_BYTES``) is an error that suggests the closest setting, as is a misspelt key
below a section (``TIERD_SHUTDOWN__GRASE``), in the file or in ``--set``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tierd.config import (
    DaemonConfig,
    default_socket_path,
    invalid_config,
    read_config_file,
)
from tierd.configfile import close_matches
from tierd.control.socketfile import CONFIG_ENV
from tierd.errors import ConfigError

__all__ = [
    "CONFIG_ENV",
    "ENV_PREFIX",
    "NON_SETTING_ENV",
    "Override",
    "effective_config_dict",
    "env_overrides",
    "load_settings",
    "parse_sets",
]

ENV_PREFIX = "TIERD_"
# TIERD_* variables that are not settings: the config file, the client commands' socket,
# and those of the set-up scripts (scripts/setup*, scripts/check_install) and the test suite.
NON_SETTING_ENV = frozenset(
    {
        CONFIG_ENV,
        "TIERD_SOCKET",
        "TIERD_SLOW",
        "TIERD_HYPOTHESIS_PROFILE",
        "TIERD_TORCH_SPEC",
        "TIERD_EXTRAS",
        "TIERD_VENV",
        "TIERD_CHECK_INSTALL_TMP",
        "TIERD_REQUIRE_ENGINES",
        "TIERD_VLLM_WHEEL",
        "TIERD_VLLM_RELOCK",
        "TIERD_VLLM_VENV",
    }
)


@dataclass(frozen=True, slots=True)
class Override:
    """One value from the environment or the command line, and where it came from."""

    path: tuple[str, ...]
    value: Any
    source: str  # "--set" or the variable's name

    @property
    def dotted(self) -> str:
        return ".".join(self.path)


def load_settings(
    path: Path | str | None,
    *,
    sets: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> DaemonConfig:
    """The daemon's config from defaults, the file at ``path`` (else ``$TIERD_CONFIG``, if
    set), ``TIERD_*`` variables of ``environ`` (default ``os.environ``) and ``sets``
    (``PATH=VALUE``), each overriding the ones before. :class:`ConfigError` lists every
    problem, one per line."""
    env = os.environ if environ is None else environ
    command_line = parse_sets(sets)
    if path is None:
        path = env.get(CONFIG_ENV) or None
    data = _defaults(env)
    if path is not None:
        _merge(data, read_config_file(path))
    sources: dict[str, str] = {}
    problems = unknown_variables(env)
    for overrides, lenient in ((env_overrides(env), True), (command_line, False)):
        for override in overrides:
            try:
                resolved = _apply(data, override, lenient=lenient)
            except ConfigError as exc:
                problems.append(str(exc))
                continue
            if resolved is not None:
                sources[resolved] = override.source
    try:
        cfg = DaemonConfig.model_validate(data)
    except ValidationError as exc:  # reported with the overrides' problems, all at once
        problems.append(str(invalid_config(exc, data, DaemonConfig, sources)))
    if problems:
        raise ConfigError("\n".join(problems))
    return cfg


def parse_sets(items: Sequence[str]) -> list[Override]:
    """``--set`` arguments (``a.b.c=value``) as overrides; :class:`ConfigError` naming the
    first one that is not ``PATH=VALUE``."""
    overrides = []
    for item in items:
        key, equals, text = item.partition("=")
        key = key.strip()
        if not equals or not key:
            raise ConfigError(f"--set {item!r}: expected PATH=VALUE, e.g. socket.mode=0o660")
        path = tuple(key.split("."))
        if "" in path:
            raise ConfigError(f"--set {item!r}: empty segment in the path {key!r}")
        overrides.append(Override(path, _parse_value(text), "--set"))
    return overrides


def env_overrides(environ: Mapping[str, str]) -> list[Override]:
    """The ``TIERD_*`` variables whose first path segment is a top-level config field,
    sorted by name."""
    overrides = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX):
            continue
        path = tuple(name.removeprefix(ENV_PREFIX).lower().split("__"))
        if path[0] in DaemonConfig.model_fields:
            overrides.append(Override(path, _parse_value(environ[name]), name))
    return overrides


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One problem per ``TIERD_*`` variable that is neither a setting nor one of
    :data:`NON_SETTING_ENV`, suggesting the closest name."""
    problems = []
    known = [name.upper() for name in DaemonConfig.model_fields]
    known += [name.removeprefix(ENV_PREFIX) for name in NON_SETTING_ENV]
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in NON_SETTING_ENV or name == ENV_PREFIX:
            continue
        first = name.removeprefix(ENV_PREFIX).lower().split("__")[0]
        if first not in DaemonConfig.model_fields:
            hint = close_matches(first.upper(), known, ENV_PREFIX)
            problems.append(f"{name}: not a setting{hint}")
    return problems


def effective_config_dict(cfg: DaemonConfig) -> dict[str, Any]:
    """``cfg`` as plain JSON-able data (paths as strings, the mode as ``"0o600"``) that
    validates back to the same config."""
    data = cfg.model_dump(mode="json")
    data["socket"]["mode"] = oct(cfg.socket.mode)
    return data


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text  # not YAML (say, "[a-z]+"): the plain string


def _defaults(environ: Mapping[str, str]) -> dict[str, Any]:
    """The lowest layer; the default socket path follows ``environ``, not the process's."""
    data = DaemonConfig().model_dump(mode="json")
    data["socket"]["path"] = str(default_socket_path(environ))
    return data


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> None:
    """Merge ``top`` into ``base``: mappings key by key, anything else replaced."""
    for key, value in top.items():
        if isinstance(base.get(key), dict) and isinstance(value, Mapping):
            _merge(base[key], value)
        else:
            base[key] = value


def _apply(data: dict[str, Any], override: Override, *, lenient: bool) -> str | None:
    """Put ``override`` into ``data``; returns the path it landed on (list items by index),
    or ``None`` when ``lenient`` and it would replace a section with a plain value."""
    node: Any = data
    resolved: list[str] = []
    for segment in override.path[:-1]:
        key = _key(node, segment, resolved, override)
        resolved.append(str(key))
        if isinstance(node, dict) and node.get(key) is None:
            node[key] = {}  # a section the lower layers left out
        node = node[key]
    key = _key(node, override.path[-1], resolved, override)
    resolved.append(str(key))
    current = node.get(key) if isinstance(node, dict) else node[key]
    if isinstance(current, dict) and isinstance(override.value, Mapping):
        _merge(current, override.value)
    elif isinstance(current, dict) and lenient:
        return None
    else:
        node[key] = override.value
    return ".".join(resolved)


def _key(node: Any, segment: str, parents: list[str], override: Override) -> str | int:
    """The key or index ``segment`` names in ``node``, which sits at ``parents``."""
    parent = ".".join(parents) or "the config"
    if isinstance(node, list):
        noun = "tier" if parents == ["tiers"] else "item"
        if segment.isdigit():
            if int(segment) >= len(node):
                message = f"no {noun} at index {segment} (there are {len(node)})"
                raise _problem(override, message)
            return int(segment)
        for index, item in enumerate(node):
            if isinstance(item, dict) and item.get("name") == segment:
                return index
        names = [str(item.get("name")) for item in node if isinstance(item, dict)]
        message = f"no {noun} named {segment!r} in {parent} ({', '.join(names) or 'none'})"
        raise _problem(override, message)
    if not isinstance(node, dict):
        raise _problem(override, f"{parent} is a value ({node!r}), not a section or a list")
    if segment.isdigit():
        raise _problem(override, f"{parent} is not a list, so {segment} is not an index")
    return segment


def _problem(override: Override, message: str) -> ConfigError:
    return ConfigError(message, path=f"{override.dotted} (from {override.source})")
