"""Configuration: YAML -> strict pydantic models.

Only this layer reads files and environment variables; everything below takes plain
constructor arguments. Sizes are bytes (``4096``) or strings with a unit (``"64GiB"``,
``"2 MiB"``, ``"512KB"``); a tier's ``capacity`` is a number of blocks (``4096`` or
``"4096 blocks"``) or a size (``"64GiB"``, divided by ``block_bytes``). Unknown keys are
errors. :func:`load_config` turns every validation problem into a :class:`ConfigError`
whose lines name the YAML path (``tiers.1.policy``), the bad value and what is allowed.
"""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from tierd.chain import Admission
from tierd.errors import ConfigError
from tierd.keys import Medium
from tierd.policy import policy_names

__all__ = [
    "ChainConfig",
    "TierConfig",
    "TierKind",
    "TransferConfig",
    "format_validation_error",
    "load_config",
    "parse_size",
]

_M = TypeVar("_M", bound=BaseModel)

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object) -> int:
    """Bytes from ``4096``, ``"4096"``, ``"64GiB"``, ``"1.5 GB"``; raises ``ValueError``."""
    if isinstance(value, bool):
        raise ValueError("a size must be a number of bytes or a string like '64GiB'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return value
    if isinstance(value, str):
        match = _SIZE.match(value)
        unit = match.group(2).lower() if match else None
        if match and unit in _UNITS:
            return int(float(match.group(1)) * _UNITS[unit])
    raise ValueError(f"{value!r} is not a size (use bytes or a unit: KiB MiB GiB TiB KB MB GB TB)")


Size = Annotated[int, BeforeValidator(parse_size)]


class TierKind(StrEnum):
    MEMORY = "memory"
    CPU = "cpu"
    GPU = "gpu"
    DISK = "disk"

    @property
    def medium(self) -> Medium:
        return Medium(self.value.upper())


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TierConfig(_Strict):
    """One level of the chain."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    kind: TierKind
    capacity: int | str = Field(description="blocks (4096, '4096 blocks') or bytes ('64GiB')")
    policy: str = "lru"
    write_through: bool = False
    admission: str = "always"
    device: str | None = None  # gpu: "cuda:0" (or "cpu" for development)
    directories: list[Path] = Field(default_factory=list)  # disk: one slab file each
    o_direct: bool | str = "auto"  # disk: true, false or "auto" (probe)
    shm_name: str | None = None  # cpu: the /dev/shm file name (default: unique)

    @field_validator("policy")
    @classmethod
    def _policy(cls, value: str) -> str:
        if value not in policy_names():
            raise ValueError(f"policy {value!r} is not one of: {', '.join(policy_names())}")
        return value

    @field_validator("admission")
    @classmethod
    def _admission(cls, value: str) -> str:
        Admission.parse(value)
        return value

    @field_validator("o_direct")
    @classmethod
    def _o_direct(cls, value: bool | str) -> bool | str:
        if value not in (True, False, "auto"):
            raise ValueError("o_direct must be true, false or 'auto'")
        return value

    @field_validator("capacity")
    @classmethod
    def _capacity(cls, value: int | str) -> int | str:
        _capacity_parts(value)
        return value

    @model_validator(mode="after")
    def _check(self) -> TierConfig:
        if self.kind is TierKind.DISK and not self.directories:
            raise ValueError("a disk tier needs at least one entry in 'directories'")
        if self.kind is not TierKind.DISK and self.directories:
            raise ValueError(f"'directories' only applies to disk tiers, not {self.kind}")
        if self.kind is TierKind.GPU and self.device is None:
            raise ValueError("a gpu tier needs 'device' (e.g. 'cuda:0', or 'cpu' for testing)")
        return self

    def num_blocks(self, block_bytes: int) -> int:
        """The capacity in blocks for blocks of ``block_bytes``."""
        count, is_bytes = _capacity_parts(self.capacity)
        blocks = count // block_bytes if is_bytes else count
        if blocks <= 0:
            raise ConfigError(
                f"capacity {self.capacity!r} holds no block of {block_bytes} bytes",
                path=f"tiers.{self.name}.capacity",
            )
        return blocks


class TransferConfig(_Strict):
    budget_per_route: Size = 256 << 20


class ChainConfig(_Strict):
    """The chain: block size, levels fastest first, and where stores enter."""

    block_bytes: Size = 2 << 20
    tiers: list[TierConfig] = Field(min_length=1)
    entry: str | None = None  # tier name; default: the first tier
    transfer: TransferConfig = Field(default_factory=TransferConfig)

    @model_validator(mode="after")
    def _check(self) -> ChainConfig:
        if self.block_bytes <= 0:
            raise ValueError("block_bytes must be positive")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        if self.entry is not None and self.entry not in names:
            raise ValueError(f"entry {self.entry!r} is not a tier name ({', '.join(names)})")
        for tier in self.tiers:
            tier.num_blocks(self.block_bytes)
        return self

    @property
    def entry_index(self) -> int:
        names = [t.name for t in self.tiers]
        return 0 if self.entry is None else names.index(self.entry)


def _capacity_parts(value: int | str) -> tuple[int, bool]:
    """``(count, is_bytes)`` for a capacity value."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"capacity must be positive, got {value}")
        return value, False
    if isinstance(value, str):
        text = value.strip().lower()
        if text.endswith("blocks"):
            count = text.removesuffix("blocks").strip()
            if count.isdigit() and int(count) > 0:
                return int(count), False
        else:
            return parse_size(value), True
    raise ValueError(f"capacity {value!r} is not a block count or a size like '64GiB'")


def format_validation_error(error: ValidationError, prefix: str = "") -> str:
    """One line per problem: ``path: message (got value)``."""
    lines = []
    for problem in error.errors():
        path = ".".join(str(part) for part in (prefix, *problem["loc"]) if part != "")
        message = problem["msg"].removeprefix("Value error, ")
        got = problem.get("input")
        shown = "" if isinstance(got, dict | list) else f" (got {got!r})"
        lines.append(f"{path or '<root>'}: {message}{shown}")
    return "\n".join(lines)


def load_config(source: Path | str | dict[str, Any], model: type[_M]) -> _M:
    """Validate a YAML file (path) or a mapping into ``model``; :class:`ConfigError` on
    any problem, one line each, naming the YAML path."""
    data: Any
    if isinstance(source, dict):
        data = source
    else:
        path = Path(source)
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file: {exc.strerror}", path=str(path)) from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"not valid YAML: {exc}", path=str(path)) from exc
    if not isinstance(data, dict):
        raise ConfigError("the config must be a mapping at the top level")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from exc
