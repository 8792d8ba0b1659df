"""Configuration: YAML -> strict pydantic models.

Only this layer reads files and environment variables; everything below takes plain
constructor arguments. The models: :class:`ChainConfig` (the chain, also what the library
opens; :mod:`tierd.config.chain`) and :class:`DaemonConfig` (the chain plus the daemon's
sections: socket, limits, namespaces, logging, metrics, shutdown, events, tenants;
:mod:`tierd.config.daemon`), built on :mod:`tierd.config.base`. This package re-exports
them and owns :func:`load_config`. Where the daemon's values come from (file, ``TIERD_*``
environment, ``--set``) is :mod:`tierd.settings`.

Sizes are bytes (``4096``) or strings with a unit (``"64GiB"``, ``"2 MiB"``, ``"512KB"``);
a tier's ``capacity`` is a number of blocks (``4096`` or ``"4096 blocks"``) or a size
(``"64GiB"``, divided by ``block_bytes``); durations are seconds or ``"10s"``, ``"500ms"``,
``"2m"``; permission modes are octal (``0o600``, ``"0600"``, ``"600"``). Unknown keys are
errors. :func:`load_config` turns every validation problem into a :class:`ConfigError`
whose lines name the YAML path (``tiers.1.policy``), the bad value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar, cast

from pydantic import BaseModel, ValidationError

from tierd.config.chain import (
    ChainConfig,
    TierConfig,
    TierKind,
    TransferConfig,
    raw_chain_problems,
)
from tierd.config.daemon import (
    DaemonConfig,
    EventsConfig,
    LimitsConfig,
    LoggingConfig,
    MetricsConfig,
    NamespaceConfig,
    ShutdownConfig,
    SocketConfig,
    default_socket_path,
    size_class_chain,
    tenant_chain,
)
from tierd.config.remote import RemoteConfig, S3Config
from tierd.configfile import AT_PATH, format_validation_error, problem_line, read_config_file
from tierd.errors import ConfigError
from tierd.units import parse_mode, parse_seconds, parse_size

__all__ = [
    "ChainConfig",
    "DaemonConfig",
    "EventsConfig",
    "LimitsConfig",
    "LoggingConfig",
    "MetricsConfig",
    "NamespaceConfig",
    "RemoteConfig",
    "S3Config",
    "ShutdownConfig",
    "SocketConfig",
    "TierConfig",
    "TierKind",
    "TransferConfig",
    "default_socket_path",
    "format_validation_error",
    "invalid_config",
    "load_config",
    "parse_mode",
    "parse_seconds",
    "parse_size",
    "read_config_file",
    "size_class_chain",
    "tenant_chain",
]

_M = TypeVar("_M", bound=BaseModel)


def load_config(source: Path | str | dict[str, Any], model: type[_M]) -> _M:
    """Validate a YAML file (path) or a mapping into ``model``; :class:`ConfigError` on
    any problem, one line each, naming the YAML path.

    A daemon file (with ``socket``, ``limits``, ... sections) also opens as a
    :class:`ChainConfig`: it is then validated, strictly, as the :class:`DaemonConfig`
    it is, which is a :class:`ChainConfig`."""
    data = source if isinstance(source, dict) else read_config_file(source)
    target: type[BaseModel] = model
    if issubclass(DaemonConfig, model) and data.keys() - model.model_fields.keys():
        target = DaemonConfig
    try:
        return cast(_M, target.model_validate(data))
    except ValidationError as exc:
        raise invalid_config(exc, data, target) from exc


def invalid_config(
    error: ValidationError,
    data: Mapping[str, Any],
    model: type[BaseModel],
    sources: Mapping[str, str] | None = None,
) -> ConfigError:
    """Every problem of ``data`` at once, one line each. A model's cross-field rules run
    only once its fields are valid, so when some field is not, the chain's rules (unique
    tier names, the entry tier, capacities against the block size) are run here on the
    raw values too: a file's mistakes are not reported one round at a time."""
    lines = format_validation_error(error, sources=sources, model=model).splitlines()
    ran = any(e["type"] == AT_PATH and e["loc"] == () for e in error.errors())
    if issubclass(model, ChainConfig) and not ran:
        lines += [
            problem_line(path, message, sources) for path, message in raw_chain_problems(data)
        ]
    return ConfigError("\n".join(lines))
