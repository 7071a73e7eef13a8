"""The type of JSON data, for the code that reads llmtrain's JSON files (and others').

`JSON` is what `json.loads` returns: objects, arrays, strings, numbers, booleans and null. A value
read back is narrowed (`isinstance`) before it is used; what is written out is typed by the
writer's own types (`json.dumps` takes any object).
"""

from __future__ import annotations

from typing import TypeAlias

JSON: TypeAlias = dict[str, "JSON"] | list["JSON"] | str | int | float | bool | None
JSONObject: TypeAlias = dict[str, JSON]
