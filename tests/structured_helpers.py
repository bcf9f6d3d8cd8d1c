"""Seeded JSON schemas with bounded outputs, shared by the structured-output tests."""

from __future__ import annotations

import random


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random JSON schema whose every valid value is short: objects with required
    properties, enums, bounded arrays, nested objects, bounded integers, numbers, booleans,
    and strings with lengths or patterns."""
    kinds = ["integer", "boolean", "enum", "string", "pattern", "number", "array"]
    if depth < 2:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "x y", "0", "null-ish"], 3)}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[a-z]{2,5}$", "^[0-9]{3}-[A-Z]$"])}
    if kind == "array":
        low = rng.randint(0, 2)
        item = random_schema(rng, depth + 1)
        return {
            "type": "array",
            "items": item,
            "minItems": low,
            "maxItems": low + rng.randint(0, 2),
        }
    names = rng.sample(["id", "name", "tags", "ok", "score", "meta", "when"], rng.randint(1, 4))
    properties = {n: random_schema(rng, depth + 1) for n in names}
    return {"type": "object", "properties": properties, "required": names}


def generated_schemas(count: int = 20) -> list[dict]:
    """``count`` seeded schemas, each an object with one required ``root`` property."""
    return [
        {
            "type": "object",
            "properties": {"root": random_schema(random.Random(seed))},
            "required": ["root"],
        }
        for seed in range(count)
    ]
