"""What every config model shares: the strict base model, the field types that parse
sizes, modes and durations, and the error a model validator raises at one of its fields.

:class:`StrictModel` forbids unknown keys and freezes the model. ``Size``, ``Mode`` and
``Seconds`` accept the spellings of :mod:`tierd.units` (``"64GiB"``, ``"0600"``,
``"500ms"``). :func:`error_at` points a model validator's error at a path below the model,
so that :func:`tierd.configfile.format_validation_error` names that YAML path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict
from pydantic_core import PydanticCustomError

from tierd.configfile import AT_PATH
from tierd.policy.admission import Admission
from tierd.units import parse_block_size, parse_mode, parse_seconds, parse_size

__all__ = [
    "AdmissionRule",
    "BlockSize",
    "Mode",
    "Seconds",
    "Size",
    "StrictModel",
    "error_at",
    "errors_at",
]

Size = Annotated[int, BeforeValidator(parse_size)]
BlockSize = Annotated[int, BeforeValidator(parse_block_size)]  # no decimal units
Mode = Annotated[int, BeforeValidator(parse_mode)]
Seconds = Annotated[float, BeforeValidator(parse_seconds)]
_AT = AT_PATH  # the error type of error_at: format_validation_error reads its path


def _admission_rule(value: str) -> str:
    Admission.parse(value)  # raises ValueError naming what is allowed
    return value


# A level's admission rule (``always``, ``reuse>=2``, ``comeback>=0.1|sample<=0.5``, ...).
AdmissionRule = Annotated[str, AfterValidator(_admission_rule)]


def error_at(path: str, message: str) -> PydanticCustomError:
    """A validation error at ``path`` below the model whose validator raises it (a model
    validator's own errors would otherwise point at the whole model)."""
    return errors_at([(path, message)])


def errors_at(problems: Sequence[tuple[str, str]]) -> PydanticCustomError:
    """One validation error carrying every ``(path, message)`` a model validator found,
    so that a file's problems are all reported at once rather than one per attempt."""
    path, message = problems[0]
    context = {"path": path, "message": message, "problems": list(problems)}
    return PydanticCustomError(_AT, "{message}", context)


class StrictModel(BaseModel):
    """A config section: unknown keys are errors, and a validated model is frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)
