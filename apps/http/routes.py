"""Each modality's HTTP routes, registered once by the module that answers them (`register_routes`),
so that `mmgen serve` mounts the routes of the modalities it serves by iterating them: its
`/v1/models` says where each model is asked (`main_route`) and its guard knows which queue a
request's body would join before reading it (`admitting_routes`).

A handler is a function of the server's `Service` and the request (or WebSocket): the built-in
routes are `Service`'s own methods, taken from its mixins (`ImageRoutes.images`, ...); a
modality defined elsewhere registers plain functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

#: Methods a route may answer; WEBSOCKET is a WebSocket route.
METHODS = ("GET", "POST", "WEBSOCKET")

_routes: dict[str, list["Route"]] = {}


@dataclass(frozen=True)
class Route:
    """One route of a modality: its method, path and handler (a function of the service and the request)."""

    method: str
    path: str
    handler: Callable[..., Any]

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"a route's method is one of {list(METHODS)}, got {self.method!r}")


def register_routes(modality: str, *routes: Route) -> None:
    """Add `modality`'s routes, in the order given; the first POST route is where its requests are
    made. Registering a route again changes nothing; another handler for a taken method and path
    is an error."""
    taken = {(r.method, r.path): r for rs in _routes.values() for r in rs}
    for route in routes:
        if taken.get((route.method, route.path), route) != route:
            raise ValueError(f"{route.method} {route.path} is already a route")
        if (route.method, route.path) not in taken:
            taken[route.method, route.path] = route
            _routes.setdefault(modality, []).append(route)


def unregister_routes(modality: str) -> None:
    """Remove a modality's routes (a test that registers a toy modality cleans up with this)."""
    _routes.pop(modality, None)


def routes_of(modality: str) -> list[Route]:
    """The routes registered for `modality` (none: it is served by no HTTP route)."""
    return list(_routes.get(modality, ()))


def main_route(modality: str) -> str | None:
    """Where the modality's requests are made: its first POST route (None without one)."""
    return next((r.path for r in routes_of(modality) if r.method == "POST"), None)


def admitting_routes(modalities: Iterable[str]) -> dict[str, str]:
    """Each modality's main route -> the modality, for those that have one: a body posted there
    joins that modality's queue."""
    return {path: modality for modality in modalities if (path := main_route(modality)) is not None}
