"""The JSON schemas of the online benchmark's structured workloads (W1-json): one of several per
request, sized by a count of repeated items so that its valid outputs run to the request's output
length, and the check of what came back (parses, validates)."""
from __future__ import annotations

import json

_STATUS = ["in_stock", "backorder", "discontinued", "preorder"]
_EVENT = ["click", "view", "purchase", "refund", "signup"]
_TAGS = ["red", "green", "blue", "small", "large", "new", "sale", "eco"]


def _object(properties: dict) -> dict:
    """Every property required and no other: a schema's output length depends on its counts."""
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def _integer(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


def _array(items: dict, count: int) -> dict:
    return {"type": "array", "items": items, "minItems": count, "maxItems": count}


def inventory(count: int) -> dict:
    """A flat record: a bounded id, an enum, and `count` bounded integers."""
    return _object({"sku": _integer(0, 99999), "status": {"enum": _STATUS},
                    "counts": _array(_integer(0, 999), count)})


def events(count: int) -> dict:
    """An array of `count` nested objects (an enum, a boolean, a bounded integer each)."""
    event = _object({"type": {"enum": _EVENT}, "ok": {"type": "boolean"},
                     "ms": _integer(0, 9999)})
    return _object({"session": _integer(1, 999999), "events": _array(event, count)})


def profile(count: int) -> dict:
    """Strings of bounded length, a nested object, and `count` enum tags."""
    address = _object({"city": {"type": "string", "maxLength": 12},
                       "zip": _integer(10000, 99999)})
    return _object({"name": {"type": "string", "maxLength": 16}, "age": _integer(0, 120),
                    "address": address, "tags": _array({"enum": _TAGS}, count)})


def grid(count: int) -> dict:
    """`count` rows of four small integers: arrays of arrays."""
    return _object({"rows": _array(_array(_integer(0, 99), 4), count)})


SCHEMAS = {"inventory": inventory, "events": events, "profile": profile, "grid": grid}
# name: (tokens of the schema's fixed part, tokens each item adds), mean over random picks among
# the tokens llguidance's compact JSON grammar allows at each step with SmolLM2's tokenizer;
# within 10% of it at 16 items. Another tokenizer or grammar engine (xgrammar writes ", " and
# allows more splits) runs shorter or longer; the run reports how outputs ended.
CALIBRATION = {"inventory": (17.0, 3.7), "events": (12.0, 17.2), "profile": (36.0, 2.9),
               "grid": (5.0, 11.2)}
FILL = 0.85  # of max_tokens that a schema's outputs take on average: the rest is headroom


def schema_for(index: int, max_tokens: int) -> tuple[str, dict]:
    """Request `index`'s schema: the schemas in turn, each with as many items as fill FILL of
    `max_tokens`; one whose single item would not fit passes the request to the next."""
    names = list(SCHEMAS)
    for step in range(len(names)):
        name = names[(index + step) % len(names)]
        fixed, per_item = CALIBRATION[name]
        count = int((FILL * max_tokens - fixed) // per_item)
        if count >= 1:
            return name, SCHEMAS[name](count)
    return "grid", grid(1)  # an output length below every schema's smallest: cut by max_tokens


def check_output(text: str, schema: dict) -> str:
    """"valid", "invalid" (JSON the schema refuses) or "unparsable"."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError:
        return "unparsable"
    errors = jsonschema.Draft202012Validator(schema).iter_errors(value)
    return "invalid" if next(errors, None) is not None else "valid"
