"""The ``rollouts:`` table and ``upstream_model`` in the settings, and the live table."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from gateway.rollouts import LiveRollouts, parse_rollouts, resolve_version
from gateway.settings import GatewaySettings


def config(**changes: Any) -> dict[str, Any]:
    def model(window: int = 4096, **fields: Any) -> dict[str, Any]:
        return {"upstreams": ["unix:/run/x.sock"], "context_window": window, **fields}

    data: dict[str, Any] = {
        "models": {
            "small": model(),
            "large-v1": model(8192, upstream_model="meta-llama/Llama-3.1-8B-Instruct"),
            "large-v2": model(16384, prices={"input": 7}),
        },
        "rollouts": {"large": {"large-v1": 95, "large-v2": 5}},
        "routing": {"aliases": {"auto": {"small": "small", "large": "large"}}},
    }
    data.update(changes)
    return data


def test_a_rollout_is_a_public_name_over_versions_that_are_models() -> None:
    settings = GatewaySettings.from_dict(config())
    assert dict(settings.rollouts["large"].weights) == {"large-v1": 95, "large-v2": 5}
    # Every name is callable (a version too, pinned); /v1/models lists the public ones.
    assert settings.known_models == {"small", "large", "large-v1", "large-v2", "auto"}
    assert settings.public_models(settings.rollouts) == {"small", "large", "auto"}
    # Each version keeps its own model entry: window, prices, upstream id.
    assert settings.models["large-v2"].context_window == 16384
    assert settings.models["large-v2"].prices.input == 7
    assert settings.models["large-v1"].upstream_id == "meta-llama/Llama-3.1-8B-Instruct"
    assert settings.models["large-v2"].upstream_id == "large-v2"  # default: the name


def test_an_alias_may_point_at_a_rollout() -> None:
    settings = GatewaySettings.from_dict(config())
    assert settings.routing is not None
    assert settings.routing.aliases["auto"].large == "large"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rollouts": {"large": {"large-v3": 5}}}, "names version 'large-v3', which is not"),
        ({"rollouts": {"small": {"large-v1": 1}}}, "'small' is both a model and a rollout"),
        ({"rollouts": {"auto": {"large-v1": 1}}}, "'auto' is both a routing alias and a rollout"),
        ({"rollouts": {"large": {"large-v1": 0}}}, "weight of 'large-v1' must be a positive"),
        ({"rollouts": {"large": {"large-v1": 2.5}}}, "must be a positive integer, got 2.5"),
        ({"rollouts": {"large": {}}}, "rollout 'large' needs at least one version"),
        ({"rollouts": {"large": ["large-v1"]}}, "must map its versions"),
        ({"rollouts": ["large"]}, "`rollouts:` must map a public model name"),
        ({"rollouts": {"large": {"large": 1}}}, "names version 'large', which is not"),
        (
            {"routing": {"aliases": {"auto": {"small": "small", "large": "huge"}}}},
            "names 'huge', which is neither under `models:`",
        ),
    ],
)
def test_bad_rollouts_are_refused_with_what_to_fix(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GatewaySettings.from_dict(config(**change))


@pytest.mark.parametrize("value", ["", "  ", 5])
def test_upstream_model_must_be_an_id(value: object) -> None:
    data = config()
    data["models"]["small"]["upstream_model"] = value
    with pytest.raises(ValueError, match="upstream_model must be the engine's model id"):
        GatewaySettings.from_dict(data)


def test_no_rollouts_is_the_default() -> None:
    data = config()
    del data["rollouts"], data["routing"]
    settings = GatewaySettings.from_dict(data)
    assert settings.rollouts == {}
    assert resolve_version(settings.rollouts, "small", "acme", None) == "small"


def test_resolve_version_splits_tenants_by_weight_and_sticks() -> None:
    table = parse_rollouts({"large": {"large-v1": 50, "large-v2": 50}})
    chosen = Counter(resolve_version(table, "large", f"t{i}", None) for i in range(400))
    assert set(chosen) == {"large-v1", "large-v2"}
    assert min(chosen.values()) > 150
    assert all(
        resolve_version(table, "large", "acme", f"u{i}")
        == resolve_version(table, "large", "acme", f"u{i}")
        for i in range(50)
    )


def test_the_live_table_is_replaced_whole_and_keeps_its_names() -> None:
    live = LiveRollouts(parse_rollouts({"large": {"large-v1": 95, "large-v2": 5}}))
    before = live.table
    live.replace(parse_rollouts({"large": {"large-v1": 50, "large-v2": 50}}))
    assert dict(live.table["large"].weights) == {"large-v1": 50, "large-v2": 50}
    assert dict(before["large"].weights) == {"large-v1": 95, "large-v2": 5}  # untouched
    with pytest.raises(ValueError, match="adding or removing a rollout needs a restart"):
        live.replace(parse_rollouts({"large": {"large-v1": 1}, "small2": {"small": 1}}))
    assert dict(live.table["large"].weights) == {"large-v1": 50, "large-v2": 50}
