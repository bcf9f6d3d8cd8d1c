"""Structured outputs through the real service (tritonserver + sidecar, tiny random-weight
Qwen3): generated JSON schemas, regex, choice, EBNF grammar and json_object outputs always
parse and validate, streamed and not, greedy and sampled, batched with unconstrained requests
whose outputs do not change; invalid constraints are 400s naming the client's field; allowed
token ids and bad words mask tokens."""

from __future__ import annotations

import asyncio
import json
import random
import re

import jsonschema
import openai
import pytest

MAX_TOKENS = 400  # far above what the bounded schemas below need; outputs end by the grammar


def schema_strategy(rng: random.Random, depth: int = 0) -> dict:
    """A random JSON schema with a bounded output size: objects with required properties,
    enums, bounded arrays, nested objects, bounded integers, numbers, booleans, and strings
    with lengths or patterns."""
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
        item = schema_strategy(rng, depth + 1)
        return {"type": "array", "items": item, "minItems": low, "maxItems": low + rng.randint(0, 2)}
    names = rng.sample(["id", "name", "tags", "ok", "score", "meta", "when"], rng.randint(1, 4))
    properties = {n: schema_strategy(rng, depth + 1) for n in names}
    return {"type": "object", "properties": properties, "required": names}


SCHEMAS = [
    {"type": "object", "properties": {"root": schema_strategy(random.Random(seed))},
     "required": ["root"]}
    for seed in range(20)
]


def _format(schema: dict, name: str = "out") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def aclient(sidecar):
    return openai.AsyncOpenAI(base_url=sidecar.base_url, api_key="x", max_retries=0, timeout=300)


def _chat(sidecar, **kwargs):
    client = openai.OpenAI(base_url=sidecar.base_url, api_key="x", max_retries=0, timeout=300)
    messages = kwargs.pop("messages", [{"role": "user", "content": "Answer in JSON."}])
    return client.chat.completions.create(model=sidecar.model_name, messages=messages, **kwargs)


async def _run(aclient, model, schema, stream, temperature, seed):
    kwargs = dict(
        model=model,
        messages=[{"role": "user", "content": f"Give me JSON #{seed}"}],
        response_format=_format(schema),
        max_tokens=MAX_TOKENS,
        temperature=temperature,
        seed=seed,
    )
    if not stream:
        response = await aclient.chat.completions.create(**kwargs)
        return response.choices[0].message.content, response.choices[0].finish_reason
    text, reason = [], None
    async for chunk in await aclient.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
    return "".join(text), reason


async def _plain(aclient, model, i):
    response = await aclient.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Tell me something, {i}"}],
        max_tokens=12,
        temperature=0.0 if i % 2 else 0.9,
        seed=100 + i,
    )
    return response.choices[0].message.content


def test_generated_schemas_always_validate_batched_with_unchanged_neighbours(sidecar, aclient):
    """20 generated schemas, each streamed and not, greedy and sampled, all in one batch with
    unconstrained (greedy and seeded) requests, whose outputs equal their outputs alone."""
    model = sidecar.model_name

    async def main():
        alone = [await _plain(aclient, model, i) for i in range(4)]
        jobs = [
            _run(aclient, model, schema, stream=k % 2 == 1, temperature=(0.0, 1.0)[k // 2 % 2],
                 seed=k)
            for k, schema in enumerate(SCHEMAS * 2)
        ]
        plain = [_plain(aclient, model, i) for i in range(4)]
        results = await asyncio.gather(*jobs, *plain)
        return alone, results[: len(jobs)], results[len(jobs) :]

    alone, constrained, batched = asyncio.run(main())
    for k, (text, reason) in enumerate(constrained):
        assert reason == "stop", (k, text)
        jsonschema.validate(json.loads(text), SCHEMAS[k % len(SCHEMAS)])
    assert batched == alone
