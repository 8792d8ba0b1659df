"""``reload``: read the config again and apply, to the running daemon, what can change live.

What changes live (:data:`LIVE`): ``logging``; ``limits`` (deadlines and bounds; a frame
size and the connection bounds for connections opened from then on; lease bounds at
once); ``namespaces`` (for hellos from then on); ``events`` (new subscribers);
``shutdown``; ``metrics.namespaces_top``; each tier's ``admission``, ``write_through``
and ``write_behind`` and the remote level's ``admission``; who is which tenant
(``tenants.N.uids``/``gids``/``operator``, ``socket.allow_uids``/``allow_gids``: for
connections from then on) and each tenant's ``namespaces`` patterns (for hellos from
then on). Everything else (the tiers themselves and their sizes, tenants' quotas,
``block_bytes``, the socket, the metrics endpoint, the remote server, adding or removing
a tenant) needs a restart: it is named in the reply and left as it runs.

All or nothing: the new file (with the daemon's environment and ``--set`` arguments on
top, as at start) must validate, and so must the config the daemon would run after
(the new live parts over the running rest), before anything is changed; a reload that
fails changes nothing. :func:`plan_reload` decides; the daemon applies the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tierd.chain import Admission
from tierd.config import DaemonConfig
from tierd.configfile import format_validation_error
from tierd.errors import ConfigError

__all__ = ["LIVE", "ReloadPlan", "plan_reload"]

Path = tuple[str | int, ...]
_ANY = "*"
LIVE: tuple[Path, ...] = (
    ("logging",),
    ("limits",),
    ("namespaces",),
    ("events",),
    ("shutdown",),
    ("metrics", "namespaces_top"),
    ("tiers", _ANY, "admission"),
    ("tiers", _ANY, "write_through"),
    ("tiers", _ANY, "write_behind"),
    ("remote", "admission"),
    ("socket", "allow_uids"),
    ("socket", "allow_gids"),
    ("tenants", _ANY, "uids"),
    ("tenants", _ANY, "gids"),
    ("tenants", _ANY, "operator"),
    ("tenants", _ANY, "namespaces"),
)


@dataclass(frozen=True, slots=True)
class ReloadPlan:
    """What a reload runs after (``config``), the dotted paths it changes live
    (``applied``) and those it leaves as they run until a restart (``restart``), and the
    admission rules of each level (and of the remote level), parsed already."""

    config: DaemonConfig
    applied: tuple[str, ...]
    restart: tuple[str, ...]
    admissions: tuple[Admission, ...]
    remote_admission: Admission | None

    def reply(self) -> dict[str, Any]:
        return {"applied": list(self.applied), "restart_needed": list(self.restart)}


def plan_reload(running: DaemonConfig, new: DaemonConfig) -> ReloadPlan:
    """Compare the running config with the new one; :class:`ConfigError` when the result
    would not be a valid config (then nothing may change)."""
    old_data, new_data = running.model_dump(), new.model_dump()
    changed = differences(old_data, new_data)
    live = [path for path in changed if _is_live(path)]
    restart = [path for path in changed if not _is_live(path)]
    after = new.model_dump()
    for path in restart:  # what needs a restart keeps running as it is
        _put(after, path, old_data)
    try:
        config = DaemonConfig.model_validate(after)
    except ValidationError as exc:
        raise ConfigError(
            "the new live values do not fit the running config:\n"
            + format_validation_error(exc, model=DaemonConfig)
        ) from exc
    try:
        admissions = tuple(Admission.parse(tier.admission) for tier in config.tiers)
        remote = Admission.parse(config.remote.admission) if config.remote else None
    except ValueError as exc:
        raise ConfigError(f"an admission rule: {exc}") from exc
    return ReloadPlan(
        config, _dotted(live, old_data), _dotted(restart, old_data), admissions, remote
    )


def differences(old: Any, new: Any, path: Path = ()) -> list[Path]:
    """The paths where ``old`` and ``new`` (plain data) differ, as deep as they line up:
    lists of named entries (tiers, tenants) line up entry by entry while their names do."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[Path] = []
        for key in sorted(set(old) | set(new), key=str):
            if key not in old or key not in new:
                out.append((*path, key))
            else:
                out.extend(differences(old[key], new[key], (*path, key)))
        return out
    if isinstance(old, list) and isinstance(new, list) and _named(old) == _named(new) != []:
        pairs = enumerate(zip(old, new, strict=True))
        return [d for i, (a, b) in pairs for d in differences(a, b, (*path, i))]
    return [] if old == new else [path]


def _named(items: Sequence[Any]) -> list[Any]:
    """The names of a list of named entries; ``[]`` for any other list."""
    if items and all(isinstance(item, dict) and "name" in item for item in items):
        return [item["name"] for item in items]
    return []


def _is_live(path: Path) -> bool:
    return any(
        len(path) >= len(rule) and all(r in (_ANY, p) for r, p in zip(rule, path, strict=False))
        for rule in LIVE
    )


def _put(data: dict[str, Any], path: Path, source: dict[str, Any]) -> None:
    """Set ``data`` at ``path`` to what ``source`` holds there (or remove it)."""
    node: Any = data
    value: Any = source
    for step in path[:-1]:
        node, value = node[step], value[step]
    last = path[-1]
    if isinstance(value, dict) and last not in value:
        node.pop(last, None)
    else:
        node[last] = value[last]


def _dotted(paths: list[Path], data: dict[str, Any]) -> tuple[str, ...]:
    """Dotted paths, an entry of a named list (a tier, a tenant) by its name."""
    out = []
    for path in paths:
        node: Any = data
        steps = []
        for step in path:
            entry = node[step] if isinstance(node, list | dict) and step in _keys(node) else None  # type: ignore[index]
            named = isinstance(node, list) and isinstance(entry, dict) and "name" in entry
            steps.append(str(entry["name"]) if named and entry is not None else str(step))
            node = entry
        out.append(".".join(steps))
    return tuple(out)


def _keys(node: list[Any] | dict[str, Any]) -> range | Any:
    return range(len(node)) if isinstance(node, list) else node.keys()
