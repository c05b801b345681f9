"""Field types shared by the gateway's request models: the chat body (gateway/openai/request_models.py)
and the realtime session config (gateway/realtime/config.py).

One definition per kind of value, so a temperature or a token budget is checked the same way whichever
API carries it: numbers finite and within what the stage protos can hold (a float32, a uint32), integers
within their proto width. A value outside is a 400 naming the field, never a protobuf error later.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BeforeValidator, Field
from pydantic_core import PydanticCustomError

# What the stage protos can hold (thinker.proto / talker.proto).
UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
FLOAT32_MAX = 3.4028234663852886e38


def _finite_float32(value: Any) -> Any:
    """A number must be finite and fit a float32; other inputs go on to the float type's own check.

    Runs before pydantic's float validation so that an integer too large for a double (``10**400``) and
    ``NaN``/``Infinity`` get the same "finite" message, with the field named, as ``1e39``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    try:
        out = float(value)
    except OverflowError:  # an integer too large for a double
        out = math.inf
    if not math.isfinite(out) or abs(out) > FLOAT32_MAX:
        raise PydanticCustomError("invalid_value", "must be a finite number (within float32 range)")
    return out


# Put after a float's ``Field`` bounds: ``Annotated[float, Field(ge=0.0, le=2.0), FINITE32]``.
FINITE32 = BeforeValidator(_finite_float32)

# Sampling numbers, the same for the chat body, its per-stage lists and a realtime session.
Temperature = Annotated[float, Field(ge=0.0, le=2.0), FINITE32]
TopP = Annotated[float, Field(ge=0.0, le=1.0), FINITE32]
RepetitionPenalty = Annotated[float, Field(ge=0.0, le=10.0), FINITE32]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0), FINITE32]  # presence / frequency
NonNegativeFloat32 = Annotated[float, Field(ge=0.0), FINITE32]
# Integers as the protos hold them.
UInt32 = Annotated[int, Field(ge=0, le=UINT32_MAX)]
PositiveUInt32 = Annotated[int, Field(ge=1, le=UINT32_MAX)]
Seed = Annotated[int, Field(ge=0, le=UINT64_MAX)]
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX, description="-1 or 0: disabled")]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
