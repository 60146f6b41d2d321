"""The request layer's contract (`mmgen.apps.requests.service`): every modality of
`mmgen.registry.MODALITIES` registers exactly one `ModalityService` that keeps it, and `mmgen
serve` builds its catalogues, `/v1/models`, limits, metrics and routes from the registered
services, so a modality it was never told about (a toy, registered here alone) is discovered,
listed, bounded by the server's settings and answered, and gone once unregistered.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("fastapi")
from fastapi import Request  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from mmgen import registry  # noqa: E402
from mmgen.apps.http.routes import Route, main_route, register_routes, unregister_routes  # noqa: E402
from mmgen.apps.requests.bounds import checked_text, integer  # noqa: E402
from mmgen.apps.requests.catalog import Catalog  # noqa: E402
from mmgen.apps.requests.runs import finish  # noqa: E402
from mmgen.apps.requests.service import (  # noqa: E402
    ModalityService, register_service, service, services, unregister_service)
from mmgen.apps.server import ServerSettings, create_app, discover_catalogs  # noqa: E402
from tests.video.tiny import tiny_video_pipeline  # noqa: E402

KEY = "contract-key"
TOY, TOY_MODEL, TOY_ROUTE = "toy", "toy-echo", "/v1/toys"


def test_every_modality_registers_exactly_one_service_that_keeps_the_contract():
    import mmgen.apps.server  # noqa: F401 (registers the built-in routes)

    found = services()
    settings = {f.name for f in dataclasses.fields(ServerSettings)}
    assert list(found)[:len(registry.MODALITIES)] == list(registry.MODALITIES)
    for modality in registry.MODALITIES:
        kept = found[modality]
        assert isinstance(kept, ModalityService) and kept.modality == modality and service(modality) is kept
        assert issubclass(kept.catalog, Catalog)
        assert dataclasses.is_dataclass(kept.request) and "model" in {f.name for f in dataclasses.fields(kept.request)}
        assert kept.noun and kept.unit and set(kept.limits) <= settings  # the server's settings bound every limit
        assert sys.modules[f"mmgen.apps.requests.{modality}"].SERVICE is kept  # its module registered it, once
        assert main_route(modality) is not None  # and `mmgen serve` answers it

        class Second(type(kept)):
            pass

        with pytest.raises(ValueError, match="already has a service"):
            register_service(Second())
        assert service(modality) is kept
    with pytest.raises(ValueError, match="no modality 'nope'"):
        service("nope")


def test_each_bundled_model_is_taken_by_exactly_one_modalitys_catalogue():
    """Each catalogue recognises its own models only (the text one took every bundled name, the
    video one every pipeline folder), so the order the services are tried in decides nothing."""
    for name in registry.bundled_models():
        taking = []
        for modality, kept in services().items():
            try:
                kept.discover([name])  # checks the entry's files; loads nothing
            except ValueError:
                continue
            taking.append(modality)
        assert len(taking) == 1, (name, taking)


def test_a_request_is_parsed_into_its_typed_request_before_any_work():
    speech = service("speech")
    ask = speech.parse(model="m", text="hi", temperature=None)
    assert isinstance(ask, speech.request) and ask.temperature is None and ask.method == "ar"  # None: the default
    with pytest.raises(ValueError, match="no field 'txet'"):
        speech.parse(model="m", txet="hi")


# --- a toy modality, registered by this test alone --------------------------------------------


class ToyPipeline:
    """What a catalogue asks of a loaded model: its decoding methods and their companions."""

    companions: dict = {}
    default_decoding = "ar"

    def decoders(self) -> dict:
        return {"ar": object}


class ToyCatalog(Catalog):
    modality = TOY

    @classmethod
    def discover(cls, models=None, device="cpu") -> "ToyCatalog":
        if any(entry != TOY_MODEL for entry in models or [TOY_MODEL]):
            raise ValueError("not a toy model")
        return cls({TOY_MODEL: TOY_MODEL}, device=device)

    def load(self, source: str) -> Any:
        return ToyPipeline()


@dataclass(frozen=True)
class ToyRequest:
    model: str
    text: str = ""
    repeat: int = 1


class ToyService(ModalityService):
    """Echoes its text `repeat` times, one more each update; `repeat` is bounded by its limit
    `max_images`, so a server's setting of that name bounds it."""

    noun, unit = "toy", "letter"
    catalog, request = ToyCatalog, ToyRequest

    def check(self, request: ToyRequest, catalog: ToyCatalog, max_images: int = 8) -> tuple[str, int]:
        catalog.main_pipeline(request.model)
        return checked_text("the text", request.text), integer("repeat", request.repeat, 1, max_images)

    def stream(self, checked: tuple[str, int], catalog: ToyCatalog):
        text, repeat = checked
        for k in range(1, repeat):
            yield text * k
        return text * repeat


async def toy_route(server: Any, request: Request) -> JSONResponse:
    """The toy's route: admitted, checked by the service within the server's limits, then run."""
    body = await request.json()
    catalog, model = server.find(TOY, body.get("model"))
    ask = server.services[TOY].parse(model=model, text=body.get("text"), repeat=body.get("repeat"))
    ticket = server.admission.admit(TOY, model)
    checked = await server.admitted(ticket, server.checker(TOY, ask, catalog))
    try:
        answer = await server.thread(finish, server.services[TOY].stream(checked, catalog))
    finally:
        ticket.done()
    return JSONResponse({"text": answer})


@pytest.fixture(scope="module")
def video_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("contract") / "tiny-video"
    tiny_video_pipeline().save_pretrained(folder)
    return str(folder)


@pytest.fixture
def toy():
    register_service(ToyService())
    register_routes(TOY, Route("POST", TOY_ROUTE, toy_route))
    try:
        yield
    finally:
        unregister_service(TOY)
        unregister_routes(TOY)


def test_a_toy_modality_registered_alone_is_discovered_listed_bounded_and_answered(toy, video_folder):
    catalogs = discover_catalogs([video_folder, TOY_MODEL])
    assert list(catalogs) == ["video", TOY]  # each entry went to the service whose catalogue took it
    settings = ServerSettings(api_key=KEY, max_images=3)
    with TestClient(create_app(catalogs, settings), headers={"Authorization": f"Bearer {KEY}"}) as client:
        listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert set(listed) == {"tiny-video", TOY_MODEL}
        assert (listed[TOY_MODEL]["modality"], listed[TOY_MODEL]["route"]) == (TOY, TOY_ROUTE)
        assert (listed[TOY_MODEL]["decoding"], listed[TOY_MODEL]["default_decoding"]) == (["ar"], "ar")
        assert listed["tiny-video"]["route"] == "/v1/videos"
        assert client.post(TOY_ROUTE, json={"text": "ab", "repeat": 3}).json() == {"text": "ababab"}
        refused = client.post(TOY_ROUTE, json={"text": "ab", "repeat": 4})  # above the server's max_images
        assert refused.status_code == 400 and "repeat" in refused.json()["error"]["message"]
        other = client.post(TOY_ROUTE, json={"model": "tiny-video", "text": "ab"}).json()["error"]
        assert other["code"] == "model_not_found" and "is a video model" in other["message"]
        assert 'mmgen_queue_depth{modality="toy"} 0.0' in client.get("/metrics").text
    unregister_service(TOY)
    unregister_routes(TOY)
    with pytest.raises(ValueError, match="neither a bundled model"):
        discover_catalogs([TOY_MODEL])
    with TestClient(create_app(catalogs, settings), headers={"Authorization": f"Bearer {KEY}"}) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny-video"]
        assert client.post(TOY_ROUTE, json={"text": "ab"}).status_code == 404
