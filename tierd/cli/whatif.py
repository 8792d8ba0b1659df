"""Where a what-if keeps its state: ``replay --config``, ``replay --compare`` and
``simulate --config`` open a config's chain in this process, and a chain with a disk tier
or a remote level finds there whatever an earlier run left. So a what-if starts cold: its
disk tiers live in a private temporary directory, removed when it ends, and its remote
keys under a key prefix of its own (``<key_prefix>whatif:<random>:``), so two identical
runs give identical figures and a what-if never opens the slab files of a live daemon
that uses the same config.

``--warm DIR`` keeps the state instead: the disk tiers of config ``NAME.yaml`` live in
``DIR/NAME/<tier>-<n>`` and its remote keys under ``<key_prefix>whatif:NAME:``, so the
next run with the same ``--warm DIR`` starts where this one ended.
"""

from __future__ import annotations

import argparse
import secrets
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tierd.config import ChainConfig

__all__ = ["add_warm_option", "what_if_config"]


def add_warm_option(parser: argparse.ArgumentParser) -> None:
    """The ``--warm DIR`` option, as ``args.warm``."""
    parser.add_argument(
        "--warm",
        type=Path,
        metavar="DIR",
        help="keep the disk tiers (and remote keys) between runs in DIR; "
        "default: each run starts cold in a private temporary directory",
    )


@contextmanager
def what_if_config(cfg: ChainConfig, name: str, warm: Path | None) -> Iterator[ChainConfig]:
    """``cfg`` with its disk directories and remote key prefix moved where a what-if named
    ``name`` (the config file's stem) keeps them: a fresh temporary directory removed on
    exit, or ``warm/name`` when ``warm`` is given."""
    if warm is None:
        with tempfile.TemporaryDirectory(prefix="tierd-whatif-") as private:
            yield _moved(cfg, Path(private), f"whatif:{secrets.token_hex(8)}:")
        return
    home = warm / name
    home.mkdir(parents=True, exist_ok=True)
    yield _moved(cfg, home, f"whatif:{name}:")


def _moved(cfg: ChainConfig, home: Path, prefix: str) -> ChainConfig:
    tiers = [
        tier.model_copy(
            update={
                "directories": [home / f"{tier.name}-{n}" for n in range(len(tier.directories))]
            }
        )
        for tier in cfg.tiers
    ]
    remote = cfg.remote
    if remote is not None:
        remote = remote.model_copy(update={"key_prefix": remote.key_prefix + prefix})
    return cfg.model_copy(update={"tiers": tiers, "remote": remote})
