"""The structured-output benchmarks' workload: eight JSON Schemas of the kinds clients send
(extraction, tool arguments, classification), each with four inputs to answer about.

Together they use nested objects, arrays bounded by ``minItems``/``maxItems``, ``enum``,
``const``, ``anyOf``, ``pattern``, integer and number ranges, required and optional
properties, and ``additionalProperties: false`` everywhere. Strings carry no ``maxLength``
(as most real schemas do not): an answer is bounded by ``max_tokens`` instead.

The tests keep their own schemas (tests never import ``bench``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SYSTEM_PROMPT = "You extract facts. Reply with one JSON object only, matching the user's request."


@dataclass(frozen=True)
class SchemaTask:
    name: str
    schema: dict[str, Any]
    instruction: str  # what the user asks, before each input
    inputs: tuple[str, ...]


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


_STRING = {"type": "string"}
_ADDRESS = _object(
    {"street": _STRING, "city": _STRING, "country": {"type": "string", "pattern": "^[A-Z]{2}$"}},
    ["city", "country"],
)

TASKS: tuple[SchemaTask, ...] = (
    SchemaTask(
        "contact",
        _object(
            {
                "name": _STRING,
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,3}$"},
                "phone": _STRING,
                "address": _ADDRESS,
            },
            ["name", "email", "address"],
        ),
        "Extract the contact (name, age, email, optional phone, address with a two-letter "
        "country code) from this text:",
        (
            "Hi, I'm Maria Lopez, 34, reach me at maria.lopez@example.com. I live at 12 Calle "
            "Mayor, Madrid, Spain.",
            "Contact: John Smith (john@acme.io), 52 years old, 221B Baker Street, London, UK. "
            "Phone +44 20 7946 0958.",
            "Akira Tanaka lives in Osaka, Japan, and answers mail at akira.t@mail.jp.",
            "Please send the contract to Lena Fischer, lena.fischer@firma.de, Hauptstrasse 5, "
            "Berlin, Germany. She is 41.",
        ),
    ),
    SchemaTask(
        "order",
        _object(
            {
                "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": _object(
                        {
                            "sku": _STRING,
                            "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                            "unit_price": {"type": "number", "minimum": 0},
                        },
                        ["sku", "quantity"],
                    ),
                },
                "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
                "shipping": {
                    "anyOf": [
                        _object({"method": {"const": "pickup"}, "store": _STRING}, ["method"]),
                        _object(
                            {"method": {"const": "delivery"}, "address": _ADDRESS},
                            ["method", "address"],
                        ),
                    ]
                },
            },
            ["order_id", "items", "status", "shipping"],
        ),
        "Turn this message into an order (order id like ABC-1234, items, status, shipping):",
        (
            "Order KLM-2291: 2 x blue mug at 8.50 each and 1 x teapot at 24.00, already paid, "
            "to be delivered to 4 Rue Cler, Paris, FR.",
            "I'd like to cancel order QRS-0042 (3 notebooks).",
            "Order ABC-7777 is shipped: 10 pens, 5 pencils, 1 stapler, delivery to Oslo, NO.",
            "New order XYZ-1000, one laptop stand, I will pick it up at the downtown store.",
        ),
    ),
    SchemaTask(
        "event",
        _object(
            {
                "title": _STRING,
                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                "start_time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
                "attendees": {"type": "array", "items": _STRING, "maxItems": 5},
                "location": _STRING,
                "priority": {"enum": ["low", "normal", "high"]},
            },
            ["title", "date", "attendees", "priority"],
        ),
        "Make a calendar event (ISO date, 24-hour start time) from this note:",
        (
            "Team sync with Ana and Bo on 2025-03-14 at 10:30 for half an hour, room 4B.",
            "Urgent: budget review with the CFO, March 3rd 2025, 2pm, two hours.",
            "Lunch with Chris next Friday (2025-06-20) at noon at Luigi's, no rush.",
            "Quarterly planning 2025-10-01 09:00-12:00 with Dana, Eli, Fay and Gus.",
        ),
    ),
    SchemaTask(
        "review",
        _object(
            {
                "sentiment": {"enum": ["positive", "neutral", "negative"]},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
                "aspects": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": _object(
                        {
                            "aspect": _STRING,
                            "sentiment": {"enum": ["positive", "neutral", "negative"]},
                        },
                        ["aspect", "sentiment"],
                    ),
                },
                "would_recommend": {"type": "boolean"},
            },
            ["sentiment", "score", "aspects"],
        ),
        "Analyse this product review (overall sentiment, a score from 0 to 1, aspects):",
        (
            "The battery lasts two days and the screen is gorgeous, but the camera is mediocre.",
            "Arrived broken and support never answered. Avoid.",
            "It's fine. Does what it says, nothing more.",
            "Best headphones I've owned: great sound, comfy, and the case is sturdy.",
        ),
    ),
    SchemaTask(
        "weather_call",
        _object(
            {
                "location": _STRING,
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "include": {
                    "type": "array",
                    "items": {"enum": ["rain", "wind", "humidity", "uv"]},
                    "maxItems": 4,
                },
            },
            ["location", "unit", "days"],
        ),
        "Give the arguments of a weather-forecast call for this request:",
        (
            "What's the weather in Boston for the next three days, in Fahrenheit?",
            "Will it rain in Lyon tomorrow? Celsius please.",
            "Weekly forecast for Cape Town with wind and UV.",
            "How humid will Singapore be over the next 5 days?",
        ),
    ),
    SchemaTask(
        "support_reply",
        _object(
            {
                "result": {
                    "anyOf": [
                        _object({"kind": {"const": "answer"}, "text": _STRING}, ["kind", "text"]),
                        _object(
                            {"kind": {"const": "clarify"}, "question": _STRING},
                            ["kind", "question"],
                        ),
                        _object(
                            {
                                "kind": {"const": "escalate"},
                                "team": {"enum": ["billing", "technical", "legal"]},
                            },
                            ["kind", "team"],
                        ),
                    ]
                },
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            },
            ["result"],
        ),
        "Decide how support should handle this ticket (answer, clarify or escalate):",
        (
            "How do I reset my password?",
            "You charged me twice this month, I want a refund now.",
            "It doesn't work.",
            "Your app crashes whenever I open the settings page on Android 14.",
        ),
    ),
    SchemaTask(
        "invoice",
        _object(
            {
                "vendor": _STRING,
                "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{3,6}$"},
                "currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "lines": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": _object(
                        {"description": _STRING, "amount": {"type": "number", "minimum": 0}},
                        ["description", "amount"],
                    ),
                },
                "total": {"type": "number", "minimum": 0},
                "paid": {"type": "boolean"},
            },
            ["vendor", "invoice_number", "currency", "lines", "total"],
        ),
        "Read this invoice into JSON (vendor, number like INV-1234, ISO currency, lines, total):",
        (
            "Invoice INV-20931 from Northwind Ltd: consulting 1200.00, travel 340.50. Total "
            "1540.50 GBP, due in 30 days.",
            "Acme Corp bills you EUR 99.00 for the annual subscription (INV-551). Paid.",
            "INV-7702, Blue Sky Hosting: server rental 45 USD, backups 5 USD, total 50 USD.",
            "Globex invoice INV-1001: 3 hours of support at 80 CHF per hour, 240 CHF in all.",
        ),
    ),
    SchemaTask(
        "recipe",
        _object(
            {
                "name": _STRING,
                "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                "ingredients": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 6,
                    "items": _object(
                        {
                            "item": _STRING,
                            "quantity": {"type": "number", "minimum": 0},
                            "unit": {"enum": ["g", "ml", "cup", "tbsp", "tsp", "piece"]},
                        },
                        ["item", "quantity", "unit"],
                    ),
                },
                "vegetarian": {"type": "boolean"},
            },
            ["name", "servings", "ingredients", "vegetarian"],
        ),
        "Write this recipe as JSON (name, servings, ingredients with units, vegetarian):",
        (
            "Pancakes for 4: 200 g flour, 2 eggs, 300 ml milk, 1 tbsp sugar.",
            "Guacamole: 3 avocados, 1 lime, half an onion, a pinch of salt. Serves 6.",
            "Tomato soup for two with 500 g tomatoes, 1 onion and 400 ml stock.",
            "Chicken curry for 4: 600 g chicken, 2 tbsp curry paste, 400 ml coconut milk, rice.",
        ),
    ),
)


@dataclass(frozen=True)
class SchemaPrompt:
    task: SchemaTask
    messages: list[dict[str, str]]


def schema_prompts(num_prompts: int) -> list[SchemaPrompt]:
    """``num_prompts`` chat prompts, cycling through the schemas first and their inputs second
    (so 8 prompts are one per schema, 32 are every input of every schema)."""
    prompts = []
    for i in range(num_prompts):
        task = TASKS[i % len(TASKS)]
        text = task.inputs[(i // len(TASKS)) % len(task.inputs)]
        prompts.append(
            SchemaPrompt(
                task,
                [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": f"{task.instruction}\n\n{text}"},
                ],
            )
        )
    return prompts
